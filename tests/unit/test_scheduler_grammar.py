"""Structured outputs in the scheduler (``engine/core/grammar.py``), with a scripted grammar
backend: a request with a grammar waits apart until its grammar compiles (counted as waiting),
then runs; a failed compile finishes it with the error; only the grammar requests that sample in
a step get a bitmask row (a step without any carries none); sampled tokens advance the matcher
and a refused one fails the request; an abort while compiling releases it; under async
scheduling a grammar request runs every step, its step's masks sent once the token before has
landed (and an abandoned step releases the worker waiting for them); under
speculative decoding it verifies only its grammar's valid prefix of its drafts, with a bitmask
row per position."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from shoal.bus.messages.engine import AddRequest
from shoal.bus.messages.sampling import SamplingParams
from shoal.bus.messages.structured import GrammarBitmask, StructuredOutputsParams
from shoal.config.deployment import CacheConfig, SchedulerConfig
from shoal.config.speculative import SpeculativeConfig
from shoal.engine.core.engine_core import EngineCore
from shoal.engine.core.grammar import GrammarState
from shoal.engine.core.request import RequestStatus
from tests.unit.factories import (
    FakeWorker,
    make_request,
    make_scheduler,
    run_to_completion,
)

REGEX = StructuredOutputsParams(regex="[0-9]+")
REFUSED = 13  # the scripted grammar refuses this token


class ScriptedGrammars:
    """Compiles when told; accepts every token but ``REFUSED``; records what it was asked."""

    def __init__(self) -> None:
        self.compiled: set[str] = set()
        self.errors: dict[str, str] = {}
        self.started: dict[str, list[int]] = {}
        self.accepted: dict[str, list[int]] = {}
        self.masked: list[list[str]] = []
        self.drafts_seen: list[dict[str, list[int]]] = []
        self.released: list[str] = []

    def start(
        self, request_id: str, params: StructuredOutputsParams, output_token_ids: Sequence[int]
    ) -> None:
        self.started[request_id] = list(output_token_ids)

    def state(self, request_id: str) -> tuple[GrammarState, str]:
        if request_id in self.errors:
            return GrammarState.FAILED, self.errors[request_id]
        if request_id in self.compiled:
            return GrammarState.READY, ""
        return GrammarState.COMPILING, ""

    def accept(self, request_id: str, token_ids: Sequence[int]) -> bool:
        self.accepted.setdefault(request_id, []).extend(token_ids)
        return REFUSED not in token_ids

    def valid_prefix(self, request_id: str, token_ids: Sequence[int]) -> int:
        return list(token_ids).index(REFUSED) if REFUSED in token_ids else len(token_ids)

    def bitmask(
        self, request_ids: Sequence[str], drafts: Mapping[str, Sequence[int]]
    ) -> GrammarBitmask:
        rows = [rid for rid in request_ids for _ in range(len(drafts.get(rid, ())) + 1)]
        self.masked.append(rows)
        self.drafts_seen.append({rid: list(d) for rid, d in drafts.items()})
        return GrammarBitmask(rows, 1, b"\xff\xff\xff\xff" * len(rows))

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


def _setup(**overrides):  # type: ignore[no-untyped-def]
    grammars = ScriptedGrammars()
    scheduler = make_scheduler(grammar_backend=grammars, **overrides)
    scheduler.add_request(make_request("g", [1, 2, 3, 4], structured_outputs=REGEX))
    scheduler.add_request(make_request("free", [5, 6, 7, 8]))
    return grammars, scheduler


def test_a_grammar_request_waits_for_its_grammar_then_runs_with_a_mask_row() -> None:
    grammars, scheduler = _setup()
    assert grammars.started == {"g": []}
    step = scheduler.schedule()
    assert set(step.num_scheduled_tokens) == {"free"} and step.grammar is None
    assert scheduler.num_waiting == 1  # still compiling
    worker = FakeWorker(scheduler.block_size)
    scheduler.update_from_output(step, worker.execute(step.to_message()))
    grammars.compiled.add("g")
    assert scheduler.admit_compiled() == []
    step = scheduler.schedule()
    assert set(step.num_scheduled_tokens) == {"g", "free"}
    message = step.to_message()
    assert message.grammar is not None and message.grammar.req_ids == ["g"]
    outputs = scheduler.update_from_output(step, worker.execute(message))
    (g_output,) = [o for o in outputs["client"] if o.request_id == "g"]
    assert grammars.accepted["g"] == g_output.new_token_ids
    assert "free" not in grammars.accepted
    run_to_completion(scheduler, worker)
    assert grammars.released == ["g"] and scheduler.grammars is not None
    assert scheduler.grammars.num_active == 0  # steps skip the grammar work again


def test_a_grammar_that_fails_to_compile_finishes_the_request_with_its_error() -> None:
    grammars, scheduler = _setup()
    grammars.errors["g"] = "grammar not compiled: bad regex"
    (failed,) = scheduler.admit_compiled()
    assert failed.status is RequestStatus.FINISHED_ERROR
    assert failed.make_final_output().finish_reason == "error"
    assert failed.error == "grammar not compiled: bad regex"
    assert "g" not in scheduler.requests and grammars.released == ["g"]
    assert scheduler.num_waiting == 1  # the free one
    assert scheduler.grammars is not None and scheduler.grammars.num_active == 0


def test_a_refused_token_fails_the_request() -> None:
    grammars, scheduler = _setup()
    grammars.compiled.add("g")
    scheduler.admit_compiled()
    worker = FakeWorker(scheduler.block_size, token_for=lambda req_id, _: REFUSED)
    step = scheduler.schedule()
    outputs = scheduler.update_from_output(step, worker.execute(step.to_message()))
    finals = [o for o in outputs["client"] if o.request_id == "g" and o.finish_reason]
    assert [o.finish_reason for o in finals] == ["error"]
    assert "g" not in scheduler.requests and "free" in scheduler.requests


def test_an_abort_while_compiling_releases_the_request() -> None:
    grammars, scheduler = _setup()
    (aborted,) = scheduler.finish_requests("g", RequestStatus.FINISHED_ABORTED)
    assert aborted.request_id == "g" and grammars.released == ["g"]
    assert scheduler.grammars is not None and scheduler.grammars.num_active == 0
    grammars.compiled.add("g")
    assert scheduler.admit_compiled() == [] and scheduler.num_waiting == 1


def test_no_backend_refuses_a_grammar_request() -> None:
    scheduler = make_scheduler()
    with pytest.raises(ValueError, match="structured outputs are not available"):
        scheduler.add_request(make_request("g", [1, 2, 3], structured_outputs=REGEX))


def _async_core(grammars: ScriptedGrammars, *request_ids: str) -> EngineCore:
    """An engine core (async scheduling) whose requests are queued: "g" has a grammar."""
    core = EngineCore(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=16, async_scheduling=True),
        CacheConfig(block_size=4, num_gpu_blocks_override=65),
        num_blocks=65,
        max_model_len=256,
        grammar_backend=grammars,
    )
    for index, request_id in enumerate(request_ids):
        structured = REGEX if request_id == "g" else None
        params = SamplingParams(max_tokens=8, structured_outputs=structured)
        prompt = [1 + 4 * index, 2 + 4 * index, 3 + 4 * index, 4 + 4 * index]
        assert core.admit(AddRequest(request_id, prompt, params, "client", 0.0)) is None
    core.apply_inputs()
    grammars.compiled.add("g")
    core.apply_inputs()  # g joins the queue
    return core


def test_async_scheduling_sends_a_steps_masks_once_the_token_before_has_landed() -> None:
    grammars = ScriptedGrammars()
    core = _async_core(grammars, "g", "free")
    worker = FakeWorker(4)
    first = core.schedule()
    second = core.schedule()  # before the first lands: g's mask needs its first token
    assert first is not None and second is not None
    assert set(second.num_scheduled_tokens) == {"g", "free"}  # g runs every step
    assert first.to_message().grammar is not None and not first.grammar_later
    message = second.to_message()
    assert message.grammar is None and message.grammar_later
    assert core.step_grammars == []
    core.apply_result(first, worker.execute(first.to_message()))
    (late,) = core.step_grammars
    assert late.step_id == second.step_id and late.bitmask is not None
    assert late.bitmask.req_ids == ["g"]
    assert len(grammars.accepted["g"]) == 1  # its first token was in the matcher before
    core.step_grammars.clear()
    core.apply_result(second, worker.execute(message))
    assert core.step_grammars == []  # nothing else waits
    third = core.schedule()
    assert third is not None and not third.grammar_later  # nothing in flight: masks inline
    assert third.to_message().grammar is not None


def test_an_abandoned_step_releases_a_worker_waiting_for_its_masks() -> None:
    core = _async_core(ScriptedGrammars(), "g")
    core.schedule()
    second = core.schedule()
    assert second is not None and second.grammar_later
    core.fail_all("worker lost")
    assert [(g.step_id, g.bitmask) for g in core.step_grammars] == [(second.step_id, None)]


def test_a_grammar_request_verifies_only_the_drafts_its_grammar_accepts() -> None:
    ngram = SpeculativeConfig(speculative_method="ngram", num_speculative_tokens=3)
    grammars, scheduler = _setup(speculative_config=ngram)
    grammars.compiled.add("g")
    scheduler.admit_compiled()
    worker = FakeWorker(scheduler.block_size)
    step = scheduler.schedule()
    scheduler.update_from_output(step, worker.execute(step.to_message()))
    scheduler.requests["g"].spec_token_ids = [40, 41, REFUSED]
    scheduler.requests["free"].spec_token_ids = [40, 41, REFUSED]
    step = scheduler.schedule()
    assert step.num_spec_tokens == {"g": 2, "free": 3}
    assert step.grammar is not None and step.grammar.req_ids == ["g", "g", "g"]  # 2 drafts + 1
    assert grammars.masked[-1] == ["g", "g", "g"]
    assert grammars.drafts_seen[-1] == {"g": [40, 41]}  # their values, not placeholders
