"""The scheduler's LoRA rule: at most ``max_loras`` distinct adapters among the running requests;
a request whose adapter would be one too many waits, keeping its place in the queue."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.bus.messages.engine import EngineCoreOutput
from shoal.bus.messages.lora import LoRARequest
from shoal.config.deployment import CacheConfig, SchedulerConfig
from shoal.config.lora import LoRAConfig
from shoal.engine.core.adapter_limit import AdapterLimit
from shoal.engine.core.request import Request
from shoal.engine.core.request_queue import FCFSQueue
from shoal.engine.core.scheduler import Scheduler
from shoal.engine.core.scheduler_output import SchedulerOutput
from tests.unit.factories import FakeWorker, make_request

ADAPTERS = {
    name: LoRARequest(name, int_id, f"/adapters/{name}")
    for int_id, name in enumerate("ABCD", start=1)
}


def lora_scheduler(
    max_loras: int | None, *, policy: str = "fcfs", max_num_batched_tokens: int = 256
) -> Scheduler:
    """A small scheduler; ``max_loras`` None: LoRA off (no lora_config)."""
    lora_config = None if max_loras is None else LoRAConfig(enable_lora=True, max_loras=max_loras)
    return Scheduler(
        SchedulerConfig(
            async_scheduling=False,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=16,
            scheduling_policy=policy,
        ),
        CacheConfig(block_size=4, num_gpu_blocks_override=129),
        max_model_len=256,
        lora_config=lora_config,
    )


_arrivals = itertools.count()


def req(request_id: str, adapter: str | None, *, max_tokens: int = 3, priority: int = 0) -> Request:
    """A request with a distinct 6-token prompt and the named adapter (None: the base model),
    arriving after every earlier one."""
    first = 100 + 10 * sum(map(ord, request_id)) % 1000
    request = make_request(
        request_id,
        list(range(first, first + 6)),
        max_tokens=max_tokens,
        priority=priority,
        arrival_time=float(next(_arrivals)),
        ignore_eos=True,
    )
    request.lora_request = None if adapter is None else ADAPTERS[adapter]
    return request


def step(
    scheduler: Scheduler, worker: FakeWorker
) -> tuple[SchedulerOutput, dict[str, list[EngineCoreOutput]]]:
    output = scheduler.schedule()
    return output, scheduler.update_from_output(output, worker.execute(output.to_message()))


def admitted(output: SchedulerOutput) -> list[str]:
    return [new.req_id for new in output.new_requests]


def running_adapters(scheduler: Scheduler) -> set[int]:
    return {r.lora_request.lora_int_id for r in scheduler.running if r.lora_request is not None}


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_one_slot_admits_the_first_adapter_and_passes_over_the_second(policy: str) -> None:
    scheduler = lora_scheduler(1, policy=policy)
    worker = FakeWorker(4)
    requests = [req("a1", "A"), req("b", "B"), req("a2", "A"), req("plain", None, max_tokens=20)]
    for request in requests:
        scheduler.add_request(request)
    first, _ = step(scheduler, worker)
    assert admitted(first) == ["a1", "a2", "plain"]
    assert [new.lora for new in first.new_requests] == [ADAPTERS["A"], ADAPTERS["A"], None]
    # B kept its place: first in the queue
    assert scheduler.num_waiting == 1 and scheduler.waiting.peek().request_id == "b"
    steps = 1
    while scheduler.requests.get("a1") or scheduler.requests.get("a2"):
        output, _ = step(scheduler, worker)
        steps += 1
        assert "b" not in admitted(output)
        assert running_adapters(scheduler) <= {1}
    assert steps == 3  # each A request samples 3 tokens, one per step
    output, _ = step(scheduler, worker)
    assert admitted(output) == ["b"]  # the step after A's last request finished
    assert [new.lora for new in output.new_requests] == [ADAPTERS["B"]]
    assert "plain" in scheduler.requests  # the base-model request still runs beside it
    assert running_adapters(scheduler) == {2}


def test_two_slots_admit_both_adapters() -> None:
    scheduler = lora_scheduler(2)
    for request in [req("a1", "A"), req("b", "B"), req("a2", "A"), req("plain", None)]:
        scheduler.add_request(request)
    first, _ = step(scheduler, FakeWorker(4))
    assert admitted(first) == ["a1", "b", "a2", "plain"]
    assert scheduler.num_waiting == 0
    assert running_adapters(scheduler) == {1, 2}


def test_passed_over_requests_keep_their_order_in_the_queue() -> None:
    scheduler = lora_scheduler(1)
    worker = FakeWorker(4)
    for request in [
        req("a1", "A", max_tokens=1),
        req("b1", "B", max_tokens=1),
        req("c1", "C"),
        req("b2", "B", max_tokens=1),
        req("plain", None),
    ]:
        scheduler.add_request(request)
    first, _ = step(scheduler, worker)
    assert admitted(first) == ["a1", "plain"]
    assert [r.request_id for r in scheduler.waiting] == ["b1", "c1", "b2"]
    second, _ = step(scheduler, worker)  # a1 finished after one token: B's turn, both of them
    assert admitted(second) == ["b1", "b2"]
    assert [r.request_id for r in scheduler.waiting] == ["c1"]
    third, _ = step(scheduler, worker)
    assert admitted(third) == ["c1"]


def test_a_request_whose_adapter_is_running_joins_at_once() -> None:
    scheduler = lora_scheduler(1)
    worker = FakeWorker(4)
    scheduler.add_request(req("a1", "A", max_tokens=10))
    step(scheduler, worker)
    scheduler.add_request(req("b", "B"))
    scheduler.add_request(req("a2", "A"))
    output, _ = step(scheduler, worker)
    assert admitted(output) == ["a2"]
    assert [r.request_id for r in scheduler.waiting] == ["b"]


def test_requests_without_adapters_are_never_held_back() -> None:
    scheduler = lora_scheduler(1)
    worker = FakeWorker(4)
    scheduler.add_request(req("a", "A", max_tokens=10))
    step(scheduler, worker)
    for index in range(3):
        scheduler.add_request(req(f"b{index}", "B"))
        scheduler.add_request(req(f"plain{index}", None))
    output, _ = step(scheduler, worker)
    assert admitted(output) == ["plain0", "plain1", "plain2"]
    assert [r.request_id for r in scheduler.waiting] == ["b0", "b1", "b2"]


@pytest.mark.parametrize("lora_config", [None, LoRAConfig()])
def test_without_lora_a_request_with_an_adapter_is_refused(lora_config: LoRAConfig | None) -> None:
    scheduler = Scheduler(
        SchedulerConfig(async_scheduling=False),
        CacheConfig(block_size=4, num_gpu_blocks_override=65),
        max_model_len=256,
        lora_config=lora_config,
    )
    assert scheduler.max_loras == 0
    with pytest.raises(ValueError, match="LoRA adapter 'A'"):
        scheduler.add_request(req("a", "A"))
    assert "a" not in scheduler.requests and scheduler.num_waiting == 0
    assert scheduler.add_request(req("plain", None))  # the base model is served as before
    output, _ = step(scheduler, FakeWorker(4))
    assert admitted(output) == ["plain"]


def test_the_same_prompt_with_another_adapter_gets_no_prefix_hit() -> None:
    scheduler = lora_scheduler(2)
    worker = FakeWorker(4)
    prompt = list(range(300, 313))  # three full blocks

    def run(request_id: str, adapter: str | None) -> int:
        request = make_request(request_id, prompt, max_tokens=1)
        request.lora_request = None if adapter is None else ADAPTERS[adapter]
        scheduler.add_request(request)
        step(scheduler, worker)
        assert request_id not in scheduler.requests
        return request.num_cached_tokens

    assert run("first", "A") == 0
    assert run("same", "A") == 12
    assert run("other", "B") == 0
    assert run("base", None) == 0


# ----- AdapterLimit on its own


def test_adapter_limit_counts_the_running_adapters() -> None:
    running = [req("a", "A"), req("plain", None)]
    limit = AdapterLimit(2, running)
    assert limit.admits(req("a2", "A")) and limit.admits(req("b", "B"))
    limit.admitted(req("b", "B"))
    assert not limit.admits(req("c", "C"))
    assert limit.admits(req("b2", "B")) and limit.admits(req("p", None))


def test_adapter_limit_zero_is_no_rule() -> None:
    limit = AdapterLimit(0, [req("a", "A"), req("b", "B")])
    assert limit.admits(req("c", "C"))
    limit.admitted(req("c", "C"))
    assert limit.admits(req("d", "D"))


def test_adapter_limit_requeues_the_skipped_at_the_front_in_order() -> None:
    waiting = FCFSQueue()
    waiting.add(req("later", None))
    limit = AdapterLimit(1, [])
    limit.skip(req("b1", "B"))
    limit.skip(req("b2", "B"))
    limit.requeue(waiting)
    assert [r.request_id for r in waiting] == ["b1", "b2", "later"]
    limit.requeue(waiting)  # nothing skipped twice
    assert len(waiting) == 3


# ----- property: any mix of adapters


def expected_admissions(
    queue: Sequence[Request], running: Iterable[Request], max_loras: int
) -> list[str]:
    """The waiting requests one step admits when every one fits: in queue order, each whose
    adapter is none, already chosen, or one more within ``max_loras``."""
    chosen = {r.lora_request.lora_int_id for r in running if r.lora_request is not None}
    ids = []
    for request in queue:
        lora = request.lora_request
        if lora is None or lora.lora_int_id in chosen or len(chosen) < max_loras:
            if lora is not None:
                chosen.add(lora.lora_int_id)
            ids.append(request.request_id)
    return ids


@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 3),
    st.lists(
        st.tuples(st.sampled_from([None, "A", "B", "C", "D"]), st.integers(1, 4)),
        min_size=1,
        max_size=10,
    ),
)
def test_any_mix_of_adapters(max_loras: int, specs: list[tuple[str | None, int]]) -> None:
    """Every step admits exactly what the rule allows (the budget, seats and blocks never bind
    here), the running requests never use more than ``max_loras`` adapters, passed-over
    requests keep their order, and every request finishes."""
    scheduler = lora_scheduler(max_loras)
    worker = FakeWorker(4)
    requests = [
        req(f"r{index}", adapter, max_tokens=max_tokens)
        for index, (adapter, max_tokens) in enumerate(specs)
    ]
    for request in requests:
        scheduler.add_request(request)
    first = True
    for _ in range(100):
        if not scheduler.has_requests():
            break
        queue = list(scheduler.waiting)
        expected = expected_admissions(queue, scheduler.running, max_loras)
        output = scheduler.schedule()
        assert admitted(output) == expected
        assert len(running_adapters(scheduler)) <= max_loras
        scheduler.update_from_output(output, worker.execute(output.to_message()))
        if first:
            assert all(
                request.request_id in expected
                for request in requests
                if request.lora_request is None
            )
            first = False
        assert [r.request_id for r in scheduler.waiting] == [
            r.request_id for r in queue if r.request_id not in expected
        ]
    else:
        raise AssertionError("requests still unfinished")
    assert all(r.is_finished for r in requests)
