"""A step's batch order is defined once, by the wire schema (``ExecuteStep.batch_order``): new
requests, then cached ones; the engine's ``SchedulerOutput`` gives the same answer."""

from __future__ import annotations

from shoal.bus.messages.sampling import SamplingParams
from shoal.bus.messages.worker import CachedRequestData, ExecuteStep, NewRequestData
from tests.unit.factories import FakeWorker, make_requests, make_scheduler


def test_batch_order_is_new_then_cached_with_counts_in_the_same_order() -> None:
    step = ExecuteStep(
        7,
        new_requests=[
            NewRequestData("n1", [1, 2, 3], SamplingParams(), [1], 0, 3),
            NewRequestData("n2", [4, 5], SamplingParams(), [2], 0, 2),
        ],
        cached_requests=[CachedRequestData("c1", [], 9, 1), CachedRequestData("c2", [3], 4, 5)],
        finished_req_ids=["gone"],
        preempted_req_ids=["parked"],
    )
    req_ids, num_scheduled = step.batch_order()
    assert req_ids == ["n1", "n2", "c1", "c2"]
    assert num_scheduled == [3, 2, 1, 5]
    assert ExecuteStep(8).batch_order() == ([], [])


def test_scheduler_output_order_is_its_message_order() -> None:
    """The scheduler plans running requests before waiting ones, but batch order puts the newly
    admitted request first; SchedulerOutput and its message agree on it."""
    scheduler = make_scheduler(max_num_batched_tokens=20)
    worker = FakeWorker(4)
    for request in make_requests(3, 12):
        scheduler.add_request(request)
    first = scheduler.schedule()
    scheduler.update_from_output(first, worker.execute(first.to_message()))
    second = scheduler.schedule()
    assert list(second.num_scheduled_tokens) == ["req0", "req1", "req2"]  # planning order
    req_ids, num_scheduled = second.to_message().batch_order()
    assert second.req_ids == req_ids == ["req2", "req0", "req1"]
    assert num_scheduled == [second.num_scheduled_tokens[r] for r in req_ids] == [12, 1, 4]
    result = worker.execute(second.to_message())
    assert result.req_ids == second.req_ids
