"""The engine core's synchronous heart: inputs applied together before a step, aborts applied
before a step's results, admission control, and failure handling."""

from __future__ import annotations

from shoal.bus.messages.engine import AbortRequest, AddRequest
from shoal.bus.messages.sampling import SamplingParams
from shoal.bus.messages.worker import StepError, StepResult, WorkerInfo
from shoal.config.deployment import CacheConfig, SchedulerConfig, ShoalConfig
from shoal.engine.core.engine_core import EngineCore, kv_cache_shape
from tests.unit.factories import FakeWorker


def make_core(num_blocks: int = 64, max_waiting: int = 8) -> EngineCore:
    return EngineCore(
        SchedulerConfig(
            max_num_batched_tokens=64, max_num_seqs=8, max_waiting_requests=max_waiting
        ),
        CacheConfig(block_size=4),
        num_blocks=num_blocks,
        max_model_len=256,
    )


def add(
    request_id: str, prompt_len: int = 6, max_tokens: int = 4, client: str = "c1"
) -> AddRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return AddRequest(request_id, list(range(10, 10 + prompt_len)), params, client, 0.0)


def step(core: EngineCore, worker: FakeWorker):  # type: ignore[no-untyped-def]
    outputs, rejected = core.apply_inputs()
    scheduler_output = core.schedule()
    assert scheduler_output is not None
    result = worker.execute(scheduler_output.to_message())
    return outputs, rejected, scheduler_output, result


def test_requests_run_to_their_length_and_report_per_client() -> None:
    core, worker = make_core(), FakeWorker(block_size=4)
    assert core.admit(add("a", client="c1")) is None
    assert core.admit(add("b", client="c2")) is None
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    finished = set()
    for _ in range(10):
        if not core.has_work():
            break
        _, _, scheduler_output, result = step(core, worker)
        for client, outputs in core.apply_result(scheduler_output, result).items():
            for out in outputs:
                assert client == {"a": "c1", "b": "c2"}[out.request_id]
                tokens[out.request_id] += out.new_token_ids
                if out.finish_reason:
                    finished.add(out.request_id)
    assert finished == {"a", "b"}
    assert all(len(t) == 4 for t in tokens.values())
    assert core.scheduler.kv_cache_manager.usage == 0.0


def test_admission_is_bounded_and_says_overloaded() -> None:
    core = make_core(max_waiting=2)
    assert core.admit(add("a")) is None
    assert core.admit(add("b")) is None
    rejected = core.admit(add("c"))
    assert rejected is not None and rejected.code == "overloaded"
    assert core.stats().num_waiting == 2


def test_an_invalid_request_is_rejected_to_its_client() -> None:
    core = make_core()
    core.admit(add("long", prompt_len=300, client="cx"))
    _, rejected = core.apply_inputs()
    assert [(client, r.request_id, r.code) for client, r in rejected] == [("cx", "long", "invalid")]
    assert "max_model_len" in rejected[0][1].message


def test_abort_during_a_step_wins_over_its_tokens() -> None:
    core, worker = make_core(), FakeWorker(block_size=4)
    core.admit(add("a", max_tokens=50))
    _, _, scheduler_output, result = step(core, worker)
    core.apply_result(scheduler_output, result)
    _, _, scheduler_output, result = step(core, worker)
    core.queue_abort(AbortRequest(["a"]))  # arrives while the step runs
    outputs = core.apply_result(scheduler_output, result)
    (only,) = outputs["c1"]
    assert only.finish_reason == "abort" and only.new_token_ids == []
    assert not core.scheduler.requests
    core.queue_abort(AbortRequest(["a", "never-seen"]))  # idempotent
    assert core.apply_inputs() == ({}, [])


def test_an_abort_queued_behind_its_add_is_applied_in_order() -> None:
    core = make_core()
    core.admit(add("a"))
    core.queue_abort(AbortRequest(["a"]))
    outputs, _ = core.apply_inputs()
    assert [o.finish_reason for o in outputs["c1"]] == ["abort"]
    assert core.schedule() is None or not core.scheduler.requests


def test_a_failed_step_errors_its_requests_even_when_one_was_aborted() -> None:
    core, worker = make_core(), FakeWorker(block_size=4)
    core.admit(add("a", prompt_len=8, max_tokens=20))
    core.admit(add("b", prompt_len=8, max_tokens=20))
    _, _, scheduler_output, _ = step(core, worker)
    failed = StepResult(scheduler_output.step_id, error=StepError("boom", ["a", "b"]))
    core.queue_abort(AbortRequest(["a"]))
    outputs = core.apply_result(scheduler_output, failed)
    reasons = {o.request_id: o.finish_reason for o in outputs["c1"]}
    assert reasons == {"a": "error", "b": "error"}
    assert not core.scheduler.requests
    # The blocks of the failed step hold no KV: a new request with the same prompt misses.
    core.admit(add("again", prompt_len=8))
    core.apply_inputs()
    scheduler_output = core.schedule()
    assert scheduler_output is not None
    assert scheduler_output.new_requests[0].num_computed_tokens == 0


def test_fail_all_errors_everything_and_forgets_the_prefix_cache() -> None:
    core, worker = make_core(), FakeWorker(block_size=4)
    for name in ("a", "b", "c"):
        core.admit(add(name, prompt_len=8, max_tokens=30))
    _, _, scheduler_output, result = step(core, worker)
    core.apply_result(scheduler_output, result)
    outputs = core.fail_all("worker w0 died")
    finals = outputs["c1"]
    assert sorted(o.request_id for o in finals) == ["a", "b", "c"]
    assert all(o.finish_reason == "error" and o.error == "worker w0 died" for o in finals)
    assert not core.scheduler.has_requests()
    assert core.scheduler.kv_cache_manager.usage == 0.0
    core.admit(add("d", prompt_len=8))
    core.apply_inputs()
    scheduler_output = core.schedule()
    assert scheduler_output is not None
    assert scheduler_output.new_requests[0].num_computed_tokens == 0  # no stale prefix hit


def _info(num_blocks: int, max_model_len: int) -> WorkerInfo:
    return WorkerInfo("w", num_blocks, 16, max_model_len, 100, [2], "x")


def test_kv_cache_shape_takes_the_override_else_the_smallest_worker() -> None:
    infos = [_info(300, 4096), _info(200, 2048)]
    assert kv_cache_shape(ShoalConfig.from_options(model="m"), infos) == (200, 2048)
    overridden = ShoalConfig.from_options(model="m", num_gpu_blocks_override=64, max_model_len=512)
    assert kv_cache_shape(overridden, infos) == (64, 512)
    longer = ShoalConfig.from_options(model="m", max_model_len=8192)
    assert kv_cache_shape(longer, infos) == (200, 2048)  # never past what a worker can hold


def test_stats_count_finished_requests_by_reason_and_the_free_blocks() -> None:
    core, worker = make_core(num_blocks=64), FakeWorker(block_size=4)
    stopper = add("stop", max_tokens=50)
    stopper.sampling_params = SamplingParams(
        temperature=0.0, max_tokens=50, stop_token_ids=list(range(10, 60))
    )
    for msg in (add("len", max_tokens=2), stopper, add("ab", max_tokens=50), add("err", 6, 50)):
        core.admit(msg)
    _, _, scheduler_output, result = step(core, worker)
    core.apply_result(scheduler_output, result)
    assert core.stats().num_free_blocks < 63
    core.queue_abort(AbortRequest(["ab"]))
    _, _, scheduler_output, result = step(core, worker)
    core.apply_result(scheduler_output, result)
    core.fail_all("worker lost")
    stats = core.stats()
    counts = (stats.num_finished_stop, stats.num_finished_length, stats.num_finished_abort)
    assert (*counts, stats.num_finished_error) == (1, 1, 1, 1)
    assert stats.num_free_blocks == 63  # every block but the null block
