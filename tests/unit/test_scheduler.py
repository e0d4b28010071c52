"""Scheduler: budgets, chunked prefill, the step diff, stops, aborts, errors, stats."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from shoal.bus.messages.engine import EngineCoreOutput, Logprobs
from shoal.bus.messages.worker import ExecuteStep, StepError, StepResult
from shoal.engine.core.request import RequestStatus, group_final_outputs
from shoal.engine.core.scheduler import Scheduler
from shoal.engine.core.scheduler_output import SchedulerOutput
from tests.unit.factories import EOS, FakeWorker, make_request, make_requests, make_scheduler


def step(
    scheduler: Scheduler, worker: FakeWorker
) -> tuple[SchedulerOutput, dict[str, list[EngineCoreOutput]]]:
    output = scheduler.schedule()
    return output, scheduler.update_from_output(output, worker.execute(output.to_message()))


def flat(outputs: dict[str, list[EngineCoreOutput]]) -> dict[str, EngineCoreOutput]:
    return {o.request_id: o for client in outputs.values() for o in client}


def test_first_step_sends_prompts_and_block_tables_once() -> None:
    scheduler = make_scheduler()
    worker = FakeWorker(4)
    for request in make_requests(3, 10):
        scheduler.add_request(request)
    first, outputs = step(scheduler, worker)
    assert [d.req_id for d in first.new_requests] == ["req0", "req1", "req2"]
    assert [d.block_ids for d in first.new_requests] == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert all(
        d.num_computed_tokens == 0 and d.num_scheduled_tokens == 10 for d in first.new_requests
    )
    assert first.new_requests[0].prompt_token_ids == list(range(100, 110))
    assert first.new_requests[0].eos_token_ids == [EOS]
    assert first.total_num_scheduled_tokens == 30 and first.cached_requests == []
    assert sorted(flat(outputs)) == ["req0", "req1", "req2"]
    second, _ = step(scheduler, worker)
    assert second.new_requests == []
    assert [
        (d.req_id, d.num_computed_tokens, d.num_scheduled_tokens) for d in second.cached_requests
    ] == [
        ("req0", 10, 1),
        ("req1", 10, 1),
        ("req2", 10, 1),
    ]
    assert all(d.new_block_ids == [] for d in second.cached_requests)
    third, _ = step(scheduler, worker)  # position 11 ends block 3
    assert all(d.new_block_ids == [] for d in third.cached_requests)
    fourth, _ = step(scheduler, worker)  # position 12 starts a new block
    assert [d.new_block_ids for d in fourth.cached_requests] == [[10], [11], [12]]
    assert scheduler.num_running == 3 and scheduler.num_waiting == 0


def test_message_round_trips_through_msgpack() -> None:
    scheduler = make_scheduler()
    for request in make_requests(2, 6):
        scheduler.add_request(request)
    message = scheduler.schedule().to_message()
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=ExecuteStep)
    assert decoded == message


def test_chunked_prefill_splits_a_long_prompt_and_partial_steps_emit_nothing() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16)
    worker = FakeWorker(4)
    scheduler.add_request(make_request("long", list(range(100, 140))))
    chunks = []
    for _ in range(2):
        output, outputs = step(scheduler, worker)
        chunks.append(output.total_num_scheduled_tokens)
        assert outputs == {}
    output, outputs = step(scheduler, worker)
    chunks.append(output.total_num_scheduled_tokens)
    assert chunks == [16, 16, 8]
    assert flat(outputs)["long"].new_token_ids == [worker.token_for("long", 40)]


def test_running_requests_come_first_then_waiting_within_the_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=20)
    worker = FakeWorker(4)
    for request in make_requests(3, 12):
        scheduler.add_request(request)
    first, _ = step(scheduler, worker)
    assert first.num_scheduled_tokens == {"req0": 12, "req1": 8}
    second, _ = step(scheduler, worker)
    # req0 decodes (1), req1 finishes its prompt (4), req2 starts with what is left (15 → 12).
    assert second.num_scheduled_tokens == {"req0": 1, "req1": 4, "req2": 12}
    assert [d.req_id for d in second.new_requests] == ["req2"]


def test_max_num_seqs_caps_running_requests() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    for request in make_requests(5, 4):
        scheduler.add_request(request)
    output = scheduler.schedule()
    assert list(output.num_scheduled_tokens) == ["req0", "req1"]
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 3)


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits() -> None:
    scheduler = make_scheduler(
        enable_chunked_prefill=False, max_num_batched_tokens=32, max_model_len=32
    )
    scheduler.add_request(make_request("a", list(range(20)), max_tokens=4))
    scheduler.add_request(make_request("b", list(range(50, 70)), max_tokens=4))
    assert list(scheduler.schedule().num_scheduled_tokens) == ["a"]


def test_long_prefill_threshold_caps_chunks_unless_alone() -> None:
    alone = make_scheduler(long_prefill_token_threshold=8)
    alone.add_request(make_request("a", list(range(30))))
    assert alone.schedule().num_scheduled_tokens == {"a": 30}
    shared = make_scheduler(long_prefill_token_threshold=8)
    for request in make_requests(2, 30):
        shared.add_request(request)
    assert shared.schedule().num_scheduled_tokens == {"req0": 8, "req1": 8}


@pytest.mark.parametrize(
    ("sampling", "tokens", "reason", "stop_reason", "num_kept"),
    [
        ({}, [30, EOS, 31], "stop", None, 2),
        ({"ignore_eos": True, "max_tokens": 3}, [30, EOS, 31], "length", None, 3),
        ({"stop_token_ids": [31]}, [30, 31, 32], "stop", 31, 2),
        ({"max_tokens": 2}, [30, 31, 32], "length", None, 2),
        ({"max_tokens": 2, "min_tokens": 2}, [30, 31, 32], "length", None, 2),
    ],
)
def test_stop_checks_apply_token_by_token(
    sampling: dict[str, Any], tokens: list[int], reason: str, stop_reason: int | None, num_kept: int
) -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", [5, 6, 7], **sampling))
    output = scheduler.schedule()
    result = StepResult(output.step_id, ["r"], [tokens])
    final = flat(scheduler.update_from_output(output, result))["r"]
    assert final.new_token_ids == tokens[:num_kept]
    assert (final.finish_reason, final.stop_reason) == (reason, stop_reason)
    assert not scheduler.has_requests() or scheduler.finished_req_ids == ["r"]
    assert scheduler.kv_cache_manager.num_free_blocks == 64
    assert scheduler.schedule().finished_req_ids == ["r"]


def test_max_model_len_caps_the_output() -> None:
    scheduler = make_scheduler(max_model_len=12)
    worker = FakeWorker(4)
    scheduler.add_request(make_request("r", list(range(10)), max_tokens=100, ignore_eos=True))
    _, first = step(scheduler, worker)
    _, second = step(scheduler, worker)
    assert flat(first)["r"].finish_reason is None
    assert flat(second)["r"].finish_reason == "length"


def test_abort_is_idempotent_and_frees_blocks() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    worker = FakeWorker(4)
    running, waiting = make_requests(2, 8)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    step(scheduler, worker)
    finished = scheduler.finish_requests(["req0", "req1", "nope"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in finished] == ["req0", "req1"]
    assert all(r.status is RequestStatus.FINISHED_ABORTED for r in finished)
    assert scheduler.finish_requests("req0", RequestStatus.FINISHED_ABORTED) == []
    finals = group_final_outputs(finished)["client"]
    assert [(o.request_id, o.finish_reason) for o in finals] == [
        ("req0", "abort"),
        ("req1", "abort"),
    ]
    assert scheduler.kv_cache_manager.num_free_blocks == 64
    assert scheduler.has_requests()  # the worker still has to drop req0
    # Only the request the worker had is sent as finished.
    assert scheduler.schedule().finished_req_ids == ["req0"]
    assert not scheduler.has_requests()
    with pytest.raises(ValueError, match="finished status"):
        scheduler.finish_requests("req0", RequestStatus.RUNNING)


def test_result_of_a_request_aborted_during_the_step_is_ignored() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", [1, 2, 3]))
    output = scheduler.schedule()
    scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    assert scheduler.update_from_output(output, StepResult(output.step_id, ["r"], [[9]])) == {}


def test_outputs_are_grouped_by_client() -> None:
    scheduler = make_scheduler()
    worker = FakeWorker(4)
    scheduler.add_request(make_request("a", [1, 2], client_id="x"))
    scheduler.add_request(make_request("b", [3, 4], client_id="y"))
    scheduler.add_request(make_request("c", [5, 6], client_id="x"))
    _, outputs = step(scheduler, worker)
    assert {k: [o.request_id for o in v] for k, v in outputs.items()} == {
        "x": ["a", "c"],
        "y": ["b"],
    }


def test_failed_step_finishes_named_requests_with_an_error() -> None:
    scheduler = make_scheduler()
    worker = FakeWorker(4)
    for request in make_requests(2, 8, max_tokens=3):
        scheduler.add_request(request)
    output = scheduler.schedule()
    worker.execute(output.to_message())
    result = StepResult(output.step_id, error=StepError("CUDA exploded", ["req0", "req1"]))
    finals = flat(scheduler.update_from_output(output, result))
    assert {(o.finish_reason, o.error) for o in finals.values()} == {("error", "CUDA exploded")}
    assert scheduler.kv_cache_manager.num_free_blocks == 64
    assert scheduler.kv_cache_manager.block_pool.num_cached_hashes == 0  # KV not trusted
    assert scheduler.schedule().finished_req_ids == ["req0", "req1"]
    assert not scheduler.has_requests()


def test_requests_missing_from_a_result_are_recomputed() -> None:
    scheduler = make_scheduler()
    worker = FakeWorker(4)
    for request in make_requests(2, 8, max_tokens=3):
        scheduler.add_request(request)
    output = scheduler.schedule()
    full = worker.execute(output.to_message())
    partial = StepResult(output.step_id, full.req_ids[:1], full.sampled_token_ids[:1])
    scheduler.update_from_output(output, partial)
    assert scheduler.requests["req1"].status is RequestStatus.PREEMPTED
    nxt = scheduler.schedule()
    assert nxt.preempted_req_ids == ["req1"]
    worker.execute(nxt.to_message())  # the worker drops req1 then sees it again
    assert [d.req_id for d in nxt.new_requests] == ["req1"]


def test_request_missing_from_a_result_does_not_hit_its_own_unwritten_blocks() -> None:
    scheduler = make_scheduler()
    worker = FakeWorker(4)
    for request in make_requests(2, 8, max_tokens=3):
        scheduler.add_request(request)
    output = scheduler.schedule()
    message = output.to_message()
    message.new_requests = message.new_requests[:1]  # the worker never ran req1
    scheduler.update_from_output(output, worker.execute(message))
    assert scheduler.requests["req1"].status is RequestStatus.PREEMPTED
    for _ in range(20):  # the worker checks every KV slot req1 reads when it resumes
        if not scheduler.has_requests():
            break
        step(scheduler, worker)
    assert not scheduler.has_requests()


def test_step_id_mismatch_is_rejected() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", [1]))
    output = scheduler.schedule()
    with pytest.raises(ValueError, match="step"):
        scheduler.update_from_output(output, StepResult(output.step_id + 1))


def test_add_request_rejects_bad_requests() -> None:
    scheduler = make_scheduler(max_model_len=16, num_blocks=3)
    scheduler.add_request(make_request("r", [1], max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("r", [1]))
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler.add_request(make_request("long", list(range(17))))
    with pytest.raises(ValueError, match="KV cache"):
        scheduler.add_request(make_request("big", list(range(9)), max_tokens=4))


def test_stats_track_load_cache_and_tokens() -> None:
    scheduler = make_scheduler()
    worker = FakeWorker(4)
    shared = list(range(200, 208))
    for request in make_requests(2, 4, prefix=shared, max_tokens=2, ignore_eos=True):
        scheduler.add_request(request)
    step(scheduler, worker)
    stats = scheduler.make_stats()
    assert (stats.num_running, stats.num_waiting, stats.step_id) == (2, 0, 1)
    assert stats.prefix_cache_queries == 24
    # Blocks are cached when allocated, so req1 hits req0's shared prefix in the same step.
    assert stats.prefix_cache_hits == 8
    assert (stats.num_prompt_tokens, stats.num_generation_tokens) == (24, 2)
    assert stats.kv_usage == pytest.approx(4 / 64)
    step(scheduler, worker)
    assert scheduler.make_stats().num_generation_tokens == 4
    assert scheduler.make_stats().kv_usage == 0.0


def test_add_request_rejects_a_prompt_the_watermark_leaves_no_room_for() -> None:
    scheduler = make_scheduler(num_blocks=11, watermark=0.5, max_model_len=64)
    with pytest.raises(ValueError, match="watermark"):
        scheduler.add_request(make_request("r", list(range(24)), max_tokens=1))
    scheduler.add_request(make_request("ok", list(range(16)), max_tokens=1))
    assert scheduler.schedule().num_scheduled_tokens == {"ok": 16}


def test_logprob_rows_after_a_stop_are_trimmed() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", [5, 6, 7], logprobs=1))
    output = scheduler.schedule()
    rows = Logprobs([[30, 1], [EOS, 1], [31, 1]], [[-0.1, -2.0]] * 3, [1, 1, 1])
    result = StepResult(output.step_id, ["r"], [[30, EOS, 31]], logprobs=[rows])
    final = flat(scheduler.update_from_output(output, result))["r"]
    assert final.new_token_ids == [30, EOS]
    assert final.new_logprobs is not None
    assert final.new_logprobs.token_ids == [[30, 1], [EOS, 1]] and final.new_logprobs.ranks == [
        1,
        1,
    ]


def test_a_partial_prefill_reports_only_prompt_logprobs() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=4)
    scheduler.add_request(make_request("r", list(range(10, 20)), prompt_logprobs=0))
    output = scheduler.schedule()
    chunk = Logprobs([[11], [12], [13], [14]], [[-1.0]] * 4, [1, 1, 1, 1])
    result = StepResult(output.step_id, ["r"], [[]], prompt_logprobs=[chunk])
    (progress,) = scheduler.update_from_output(output, result)["client"]
    assert progress.new_token_ids == [] and progress.finish_reason is None
    assert progress.prompt_logprobs == chunk
    output = scheduler.schedule()
    assert scheduler.update_from_output(output, StepResult(output.step_id, ["r"], [[]])) == {}
