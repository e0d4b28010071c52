"""The pure engine core takes a request resumed after a fault (``AddRequest.output_token_ids``):
it recomputes prompt + those tokens, counts them against its limits, never publishes them again,
and a greedy continuation equals the run that was never interrupted (lock-step and async)."""

from __future__ import annotations

from typing import Any

import pytest

from shoal.bus.messages.engine import AddRequest, EngineCoreOutput
from shoal.bus.messages.sampling import SamplingParams
from shoal.config.deployment import CacheConfig, SchedulerConfig
from shoal.engine.core.engine_core import EngineCore
from shoal.engine.core.request import ClientOutputs
from tests.unit.factories import EOS, FakeWorker

PROMPT = [31, 32, 33, 34, 35, 36, 37, 38]  # two blocks of 4


def make_core(async_scheduling: bool = False, max_model_len: int = 256) -> EngineCore:
    return EngineCore(
        SchedulerConfig(
            max_num_batched_tokens=64, max_num_seqs=8, async_scheduling=async_scheduling
        ),
        CacheConfig(block_size=4, enable_prefix_caching=True),
        num_blocks=64,
        max_model_len=max_model_len,
    )


def history_worker() -> FakeWorker:
    """A fake worker whose greedy 'model' reads the whole sequence so far (prompt + outputs), so
    a continuation is right only if the resumed tokens reached the worker in order."""
    worker = FakeWorker(4)

    def next_token(request_id: str, position: int) -> int:
        tokens = worker.batch[request_id].token_ids[:position]
        return 10 + sum(t * (i + 1) for i, t in enumerate(tokens)) % 50

    worker.token_for = next_token
    return worker


def add(request_id: str, outputs: list[int] | None = None, **params: Any) -> AddRequest:
    params = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, **params}
    return AddRequest(
        request_id,
        PROMPT,
        SamplingParams(**params),
        "c",
        0.0,
        eos_token_ids=[EOS],
        output_token_ids=list(outputs or []),
    )


class Driver:
    """Runs an engine core on a fake worker the way its shell does (up to its steps in flight)
    and records every output per request."""

    def __init__(self, core: EngineCore, worker: FakeWorker) -> None:
        self.core, self.worker = core, worker
        self.outputs: dict[str, list[EngineCoreOutput]] = {}
        self.steps: list = []

    def record(self, outputs: ClientOutputs) -> None:
        for client_outputs in outputs.values():
            for output in client_outputs:
                self.outputs.setdefault(output.request_id, []).append(output)

    def step(self) -> None:
        core = self.core
        self.record(core.apply_inputs()[0])
        while core.can_schedule:
            scheduler_output = core.schedule()
            if scheduler_output is None or scheduler_output.is_empty:
                break
            self.steps.append(scheduler_output)
        if core.outstanding:
            oldest = core.outstanding[0]
            self.record(core.apply_result(oldest, self.worker.execute(oldest.to_message())))

    def run(self, max_steps: int = 500) -> dict[str, list[EngineCoreOutput]]:
        for _ in range(max_steps):
            if not self.core.has_work():
                return self.outputs
            self.step()
        raise AssertionError("requests unfinished")

    def tokens(self, request_id: str) -> list[int]:
        return [t for output in self.outputs.get(request_id, []) for t in output.new_token_ids]


def uninterrupted(adds: list[AddRequest], async_scheduling: bool) -> Driver:
    driver = Driver(make_core(async_scheduling), history_worker())
    for msg in adds:
        assert driver.core.admit(msg) is None
    driver.run()
    return driver


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("num_steps_before_fault", [1, 3, 6])
def test_greedy_continuation_after_resumption_equals_the_uninterrupted_run(
    async_scheduling: bool, num_steps_before_fault: int
) -> None:
    # n = 3 children of one request (same prompt), one with a stop token the model may sample.
    children = [add(f"{i}_r", max_tokens=10 + i) for i in range(3)]
    reference = uninterrupted(children, async_scheduling)

    first = Driver(make_core(async_scheduling), history_worker())
    for msg in children:
        first.core.admit(msg)
    for _ in range(num_steps_before_fault):
        first.step()
    first.core.fail_all("fault")  # what the sentinel does: outputs in flight are lost
    received = {m.request_id: first.tokens(m.request_id) for m in children}
    assert any(received.values()), "the fault must cut requests that have output already"

    second = Driver(make_core(async_scheduling), history_worker())
    for msg in children:
        second.core.admit(
            add(msg.request_id, received[msg.request_id], max_tokens=msg.sampling_params.max_tokens)
        )
    second.run()
    for msg in children:
        rid = msg.request_id
        assert received[rid] + second.tokens(rid) == reference.tokens(rid), rid
        assert second.outputs[rid][-1].finish_reason == "length"
        if received[rid]:  # the resumed request's first output carries only new tokens
            assert (
                second.outputs[rid][0].new_token_ids[0] == reference.tokens(rid)[len(received[rid])]
            )
    scheduler = second.core.scheduler
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.num_blocks - 1


def test_the_worker_recomputes_prompt_and_outputs_of_a_resumed_request() -> None:
    driver = Driver(make_core(), history_worker())
    outputs = [40, 41, 42]
    driver.core.admit(add("r", outputs, prompt_logprobs=2))
    driver.step()
    (new,) = driver.steps[0].new_requests
    assert new.output_token_ids == outputs and new.resumed  # the worker skips prompt logprobs
    assert new.num_computed_tokens == 0 and new.num_scheduled_tokens == len(PROMPT) + 3
    (output,) = driver.outputs["r"]
    assert len(output.new_token_ids) == 1 and output.prompt_logprobs is None


def test_resumed_tokens_count_against_max_tokens() -> None:
    driver = Driver(make_core(), history_worker())
    driver.core.admit(add("r", [40, 41, 42, 43], max_tokens=6))
    driver.run()
    assert len(driver.tokens("r")) == 2
    assert driver.outputs["r"][-1].finish_reason == "length"
    assert driver.core.stats().num_generation_tokens == 2


@pytest.mark.parametrize(
    ("outputs", "params", "max_model_len", "reason", "stop_reason"),
    [
        ([40, 41, 42], {"max_tokens": 3}, 256, "length", None),
        ([40, 41, 42, 43], {"max_tokens": 3}, 256, "length", None),
        ([40, 41], {}, len(PROMPT) + 2, "length", None),
        ([40, 7], {"stop_token_ids": [7]}, 256, "stop", 7),
        ([40, EOS], {"ignore_eos": False}, 256, "stop", None),
    ],
)
def test_a_resumed_request_already_at_its_end_finishes_at_once(
    outputs: list[int],
    params: dict[str, Any],
    max_model_len: int,
    reason: str,
    stop_reason: int | None,
) -> None:
    core = make_core(max_model_len=max_model_len)
    core.admit(add("r", outputs, **params))
    finished, rejected = core.apply_inputs()
    assert not rejected
    (output,) = finished["c"]
    assert (output.request_id, output.new_token_ids) == ("r", [])
    assert (output.finish_reason, output.stop_reason) == (reason, stop_reason)
    assert not core.has_work() and core.scheduler.num_waiting == 0
    assert core.stats().num_finished_length + core.stats().num_finished_stop == 1


def test_a_resumed_request_not_yet_at_a_stop_token_keeps_running() -> None:
    driver = Driver(make_core(), history_worker())
    driver.core.admit(add("r", [40, EOS], max_tokens=4))  # eos ignored (ignore_eos)
    driver.run()
    assert len(driver.tokens("r")) == 2


def test_a_resumed_request_hits_the_prefix_cache_on_its_output_tokens() -> None:
    driver = Driver(make_core(), history_worker())
    driver.core.admit(add("first", max_tokens=8))
    driver.run()
    generated = driver.tokens("first")
    # Prompt logprobs are not produced again for it, so they do not stop the cache hit.
    driver.core.admit(add("again", generated, max_tokens=12, prompt_logprobs=1))
    driver.run()
    (resumed,) = [n for step in driver.steps for n in step.new_requests if n.req_id == "again"]
    # prompt (8) + 7 outputs were fed to the model: three full blocks hold KV to reuse.
    assert resumed.num_computed_tokens == 12 > len(PROMPT)
    reference = uninterrupted([add("again", max_tokens=12)], async_scheduling=False)
    assert generated + driver.tokens("again") == reference.tokens("again")
