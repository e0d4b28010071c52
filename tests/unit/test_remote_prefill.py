"""The decode side of disaggregated prefill in the engine core (``engine.core.remote_prefill``):
a request added with ``do_remote_prefill`` pulls the remote tokens beyond its local prefix-cache
hit (whole blocks from the first one the hit does not cover), or nothing when the hit covers
them; it pulls at most once; a landed pull counts its tokens and lets its blocks be cached, a
failed one (named by the workers, or no report at all) counts them as recomputed; whatever
happens (pulled, failed, not needed, finished first, steps abandoned) the prefill side is
released exactly once, and a request without a remote prefill is none of its business. Then
the same through the ``Scheduler``: the admitted request starts with the pulled tokens
computed and the step carries its ``KVPull``; a failed pull preempts the request, which is
recomputed from token 0 without a second pull."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest

from shoal.bus.messages.engine import KVTransferParams
from shoal.bus.messages.kv_handover import KVExportRef, KVPull
from shoal.bus.messages.offload import KVTransferResult
from shoal.bus.messages.sampling import SamplingParams
from shoal.bus.messages.worker import StepResult
from shoal.engine.core.remote_prefill import RemoteHit, RemotePrefills
from shoal.engine.core.request import Request, RequestStatus
from shoal.engine.core.scheduler import Scheduler
from tests.unit.factories import FakeWorker, make_request, make_scheduler, run_to_completion

BLOCK = 4
FIRST_TOKEN = 7  # sampled by the prefill engine core


def export_ref(tp_rank: int = 0) -> KVExportRef:
    """A prefill worker's cache (never opened here: the engine core only passes it on)."""
    return KVExportRef(
        host="h",
        path=f"/proc/1/fd/{3 + tp_rank}",
        token="11" * 16,
        epoch=0,
        num_blocks=64,
        num_layers=2,
        block_size=BLOCK,
        num_kv_heads=2,
        head_dim=8,
        dtype="float32",
        tp_rank=tp_rank,
        tp_size=1,
        total_kv_heads=2,
    )


def prompt(prompt_len: int, start: int = 100) -> list[int]:
    return list(range(start, start + prompt_len))


def remote_request(
    request_id: str,
    prompt_len: int = 10,
    *,
    num_remote_tokens: int | None = None,
    remote_block_ids: list[int] | None = None,
    engine_id: str = "p0",
    remote_kv: list[KVExportRef] | None = None,
) -> Request:
    """A request continued here after a prefill on ``engine_id`` (which sampled its first
    token), holding its whole prompt in blocks 20, 21, ... there."""
    num_remote = prompt_len if num_remote_tokens is None else num_remote_tokens
    if remote_block_ids is None:
        remote_block_ids = list(range(20, 20 + -(-num_remote // BLOCK)))
    params = KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id=engine_id,
        remote_block_ids=remote_block_ids,
        num_remote_tokens=num_remote,
        remote_kv=[export_ref()] if remote_kv is None else remote_kv,
    )
    return Request(
        request_id,
        prompt(prompt_len),
        SamplingParams(max_tokens=8, ignore_eos=True),
        output_token_ids=[FIRST_TOKEN],
        remote_prefill=params,
    )


def tracked(*requests: Request) -> RemotePrefills:
    remote = RemotePrefills(BLOCK)
    for request in requests:
        remote.track(request)
    return remote


def admit(
    remote: RemotePrefills, request: Request, num_local_blocks: int, new_block_ids: list[int]
) -> RemoteHit:
    hit = remote.on_admission(request, num_local_blocks)
    assert hit is not None
    remote.on_admitted(request, hit, new_block_ids)
    return hit


def released(remote: RemotePrefills) -> list[tuple[str, str]]:
    """The releases since the last call, as (prefill engine core, request id)."""
    return [(eid, rid) for eid, rids in remote.take_releases().items() for rid in rids]


# ----- RemotePrefills on its own


@pytest.mark.parametrize(
    ("prompt_len", "new_block_ids", "expected_block_ids"),
    [
        (10, [5, 6, 7], [5, 6, 7]),  # 10 tokens: 3 blocks, the last one part full
        (8, [5, 6, 7], [5, 6]),  # 8 tokens: 2 blocks; the third new one is for token 8
    ],
)
def test_with_no_local_hit_every_remote_block_is_pulled(
    prompt_len: int, new_block_ids: list[int], expected_block_ids: list[int]
) -> None:
    request = remote_request("r", prompt_len)
    remote = tracked(request)
    hit = remote.on_admission(request, num_local_blocks=0)
    num_blocks = -(-prompt_len // BLOCK)
    assert hit == RemoteHit(0, num_blocks, prompt_len) and hit.num_blocks == num_blocks
    remote.on_admitted(request, hit, new_block_ids)
    params = request.remote_prefill
    assert params is not None
    assert remote.build(step_id=1) == [
        KVPull("r", expected_block_ids, params.remote_block_ids, [export_ref()])
    ]
    assert remote.build(step_id=2) == []  # the pulls go with one step
    assert released(remote) == [] and remote.num_waiting_release == 1  # not before it lands


def test_with_a_local_hit_the_pull_starts_after_it() -> None:
    request = remote_request("r", 10)  # remote blocks 20, 21, 22
    remote = tracked(request)
    hit = remote.on_admission(request, num_local_blocks=1)
    assert hit == RemoteHit(1, 3, 6)  # tokens 4..9
    remote.on_admitted(request, hit, [8, 9])
    assert remote.build(step_id=1) == [KVPull("r", [8, 9], [21, 22], [export_ref()])]


def test_the_remote_tokens_stop_before_the_last_known_one() -> None:
    # The prefill side says it holds more than the prompt: only the tokens before the last
    # known one are pulled (the last is computed here, for its logits).
    request = remote_request("r", 8, num_remote_tokens=12, remote_block_ids=[20, 21, 22])
    hit = tracked(request).on_admission(request, num_local_blocks=0)
    assert hit == RemoteHit(0, 2, 8)
    # ... and no more than its blocks hold.
    request = remote_request("s", 10, num_remote_tokens=10, remote_block_ids=[20, 21])
    hit = tracked(request).on_admission(request, num_local_blocks=0)
    assert hit == RemoteHit(0, 2, 8)


@pytest.mark.parametrize(
    ("request_kwargs", "num_local_blocks"),
    [
        ({"prompt_len": 8}, 2),  # the local hit covers the 8 remote tokens
        ({"prompt_len": 10, "num_remote_tokens": 4}, 1),
        ({"prompt_len": 10, "remote_kv": []}, 0),  # nowhere to pull from: recomputed here
    ],
)
def test_a_request_that_needs_no_pull_releases_the_prefill_side_at_once(
    request_kwargs: dict[str, object], num_local_blocks: int
) -> None:
    request = remote_request("r", **request_kwargs)  # type: ignore[arg-type]
    remote = tracked(request)
    assert remote.on_admission(request, num_local_blocks) is None
    assert released(remote) == [("p0", "r")] and remote.num_waiting_release == 0
    assert remote.build(step_id=1) == []
    assert remote.on_admission(request, num_local_blocks) is None  # not admitted: asked again
    remote.forget(request)
    assert released(remote) == []


def test_a_request_pulls_at_most_once() -> None:
    request = remote_request("r", 10)
    remote = tracked(request)
    admit(remote, request, 0, [5, 6, 7])
    remote.build(step_id=1)
    assert remote.on_landed(1, KVTransferResult()) == ["r"]
    assert released(remote) == [("p0", "r")]
    # Preempted later: recomputed (or hit locally), never pulled again nor released again.
    assert remote.on_admission(request, 0) is None
    assert remote.build(step_id=2) == [] and released(remote) == []
    # Likewise when admitted again before its pull's step landed.
    other = remote_request("s", 10)
    remote.track(other)
    admit(remote, other, 0, [8, 9, 10])
    remote.build(step_id=3)
    assert remote.on_admission(other, 0) is None


def test_a_landed_pull_counts_its_tokens_and_a_failed_one_its_recomputed_tokens() -> None:
    ok, failed = remote_request("ok", 10), remote_request("failed", 7, engine_id="p1")
    remote = tracked(ok, failed)
    admit(remote, ok, 1, [5, 6])  # 6 tokens pulled after a one-block hit
    admit(remote, failed, 0, [8, 9])  # 7 tokens
    assert [pull.req_id for pull in remote.build(step_id=4)] == ["ok", "failed"]
    result = KVTransferResult(failed_pull_req_ids=["failed"], num_pull_bytes=1234, pull_time_s=0.5)
    assert remote.on_landed(4, result) == ["ok"]
    counters = remote.counters
    assert (counters.num_pulls, counters.num_pulled_tokens) == (1, 6)
    assert (counters.num_failed_pulls, counters.num_recomputed_tokens) == (1, 7)
    assert (counters.num_pull_bytes, counters.pull_time_s) == (1234, 0.5)
    assert remote.take_releases() == {"p0": ["ok"], "p1": ["failed"]}
    assert remote.on_landed(4, result) == []  # a step lands once
    assert counters.num_pulls == 1 and counters.num_failed_pulls == 1


def test_a_step_that_reports_nothing_fails_every_pull_it_carried() -> None:
    first, second = remote_request("a", 10), remote_request("b", 5)
    remote = tracked(first, second)
    admit(remote, first, 0, [1, 2, 3])
    admit(remote, second, 0, [4, 5])
    remote.build(step_id=1)
    assert remote.on_landed(1, None) == []
    counters = remote.counters
    assert (counters.num_pulls, counters.num_failed_pulls) == (0, 2)
    assert counters.num_recomputed_tokens == 15 and counters.num_pulled_tokens == 0
    assert released(remote) == [("p0", "a"), ("p0", "b")]


def landed_ok(remote: RemotePrefills, request: Request) -> None:
    admit(remote, request, 0, [1, 2, 3])
    remote.build(step_id=1)
    remote.on_landed(1, KVTransferResult())
    remote.forget(request)


def landed_failed(remote: RemotePrefills, request: Request) -> None:
    admit(remote, request, 0, [1, 2, 3])
    remote.build(step_id=1)
    remote.on_landed(1, KVTransferResult(failed_pull_req_ids=[request.request_id]))
    remote.on_admission(request, 0)  # preempted and admitted again: recomputed
    remote.forget(request)


def finished_before_admission(remote: RemotePrefills, request: Request) -> None:
    remote.forget(request)  # aborted while waiting
    remote.abandon()


def finished_while_its_pull_is_in_flight(remote: RemotePrefills, request: Request) -> None:
    admit(remote, request, 0, [1, 2, 3])
    remote.build(step_id=1)
    remote.forget(request)  # aborted meanwhile: the worker may still be reading the hold
    assert remote.take_releases() == {}
    remote.on_landed(1, KVTransferResult())


def abandoned_in_flight(remote: RemotePrefills, request: Request) -> None:
    admit(remote, request, 0, [1, 2, 3])
    remote.build(step_id=1)
    remote.abandon()  # a fault: the step will never land
    assert remote.counters.num_failed_pulls == 1
    remote.on_landed(1, KVTransferResult())  # (late: nothing of it is left)


def abandoned_before_its_step_was_built(remote: RemotePrefills, request: Request) -> None:
    admit(remote, request, 0, [1, 2, 3])
    remote.abandon()
    remote.forget(request)  # the fault finishes it


def no_pull_needed(remote: RemotePrefills, request: Request) -> None:
    remote.on_admission(request, 2)  # the local hit covers its 8 tokens
    remote.forget(request)


@pytest.mark.parametrize(
    "path",
    [
        landed_ok,
        landed_failed,
        finished_before_admission,
        finished_while_its_pull_is_in_flight,
        abandoned_in_flight,
        abandoned_before_its_step_was_built,
        no_pull_needed,
    ],
    ids=lambda path: path.__name__,
)
def test_every_path_releases_the_prefill_side_exactly_once(
    path: Callable[[RemotePrefills, Request], None],
) -> None:
    request = remote_request("r", 8)
    bystander = remote_request("bystander", 6, engine_id="p1")  # tracked, never admitted
    remote = tracked(request, bystander)
    assert remote.num_waiting_release == 2
    path(remote, request)
    assert released(remote) == [("p0", "r")]
    assert remote.num_waiting_release == 1  # only the bystander's
    remote.forget(request)
    remote.abandon()
    assert released(remote) == []
    assert remote.build(step_id=9) == []


def test_a_request_without_a_remote_prefill_is_ignored() -> None:
    request = make_request("plain", prompt(10))
    remote = tracked(request)
    assert remote.num_waiting_release == 0
    assert remote.on_admission(request, 0) is None
    remote.forget(request)
    assert remote.take_releases() == {} and remote.build(step_id=1) == []
    assert remote.on_landed(1, None) == [] and remote.counters.num_failed_pulls == 0


# ----- through the scheduler


def scheduler() -> Scheduler:
    return make_scheduler(block_size=BLOCK)


def test_the_scheduler_admits_a_remote_prefill_with_its_pulled_tokens_computed() -> None:
    sched = scheduler()
    request = remote_request("r", 10)
    sched.add_request(request)
    step = sched.schedule()
    block_ids = sched.kv_cache_manager.get_block_ids("r")
    assert len(block_ids) == 3  # 11 tokens
    assert step.kv_pulls == [KVPull("r", block_ids, [20, 21, 22], [export_ref()])]
    (new,) = step.to_message().new_requests
    assert new.num_computed_tokens == 10 and new.num_scheduled_tokens == 1
    assert step.to_message().kv_pulls == step.kv_pulls
    result = StepResult(step.step_id, ["r"], [[9]], kv_transfer=KVTransferResult())
    sched.update_from_output(step, result)
    assert request.status is RequestStatus.RUNNING and request.output_token_ids == [7, 9]
    counters = sched.remote_prefills.counters
    assert (counters.num_pulls, counters.num_pulled_tokens) == (1, 10)
    assert sched.remote_prefills.take_releases() == {"p0": ["r"]}
    # The pulled KV landed: its full blocks are in the prefix cache.
    pool = sched.kv_cache_manager.block_pool
    assert all(pool.get_cached_block(h) is not None for h in request.block_hashes[:2])
    stats = sched.make_stats()
    assert (stats.kv_pulls, stats.kv_pulled_tokens) == (1, 10)


def test_the_scheduler_pulls_only_what_its_prefix_cache_misses() -> None:
    sched = scheduler()
    sched.add_request(make_request("local", prompt(10), max_tokens=2, ignore_eos=True))
    run_to_completion(sched, FakeWorker(BLOCK))  # leaves the prompt's 2 full blocks cached
    request = remote_request("r", 10)
    sched.add_request(request)
    step = sched.schedule()
    block_ids = sched.kv_cache_manager.get_block_ids("r")
    assert step.kv_pulls == [KVPull("r", block_ids[2:3], [22], [export_ref()])]
    (new,) = step.to_message().new_requests
    assert new.num_computed_tokens == 10 and new.num_scheduled_tokens == 1


def test_a_failed_pull_is_recomputed_from_token_0_without_a_second_pull() -> None:
    sched = scheduler()
    request = remote_request("r", 10)
    sched.add_request(request)
    step = sched.schedule()
    assert [pull.req_id for pull in step.kv_pulls] == ["r"]
    # The workers could not pull: they left the request out of the step.
    failed = KVTransferResult(failed_pull_req_ids=["r"])
    outputs = sched.update_from_output(step, StepResult(step.step_id, [], [], kv_transfer=failed))
    assert outputs == {}  # nothing to publish: it goes on, from the start
    assert request.status is RequestStatus.PREEMPTED and request.num_computed_tokens == 0
    counters = sched.remote_prefills.counters
    assert (counters.num_failed_pulls, counters.num_recomputed_tokens) == (1, 10)
    assert counters.num_pulls == 0
    assert sched.remote_prefills.take_releases() == {"p0": ["r"]}
    step = sched.schedule()
    assert step.kv_pulls == []
    (new,) = step.to_message().new_requests
    assert new.num_computed_tokens == 0 and new.num_scheduled_tokens == 11  # prompt + token 7
    assert step.to_message().preempted_req_ids == ["r"]
    sched.update_from_output(step, StepResult(step.step_id, ["r"], [[9]]))
    assert request.output_token_ids == [7, 9] and request.status is RequestStatus.RUNNING
    assert sched.remote_prefills.take_releases() == {}


def test_a_remote_prefill_aborted_before_admission_is_released_once() -> None:
    sched = scheduler()
    sched.add_request(remote_request("r", 10))
    sched.add_request(remote_request("s", 10, engine_id="p1"))
    sched.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    assert sched.remote_prefills.take_releases() == {"p0": ["r"]}
    step = sched.schedule()
    assert [pull.req_id for pull in step.kv_pulls] == ["s"]
    assert sched.remote_prefills.take_releases() == {}


def test_a_pulled_request_preempted_later_is_not_pulled_again() -> None:
    sched = scheduler()
    request = remote_request("r", 10)
    sched.add_request(request)
    step = sched.schedule()
    pulled = KVTransferResult(num_pull_bytes=640)  # what workers that pulled report
    sched.update_from_output(step, StepResult(step.step_id, ["r"], [[9]], kv_transfer=pulled))
    assert sched.remote_prefills.take_releases() == {"p0": ["r"]}
    step = sched.schedule()  # its next token; the worker leaves it out (lost its state)
    sched.update_from_output(step, StepResult(step.step_id, [], []))
    assert request.status is RequestStatus.PREEMPTED
    step = sched.schedule()
    assert step.kv_pulls == []
    (new,) = step.to_message().new_requests
    assert new.num_computed_tokens == 8  # the pulled full blocks, cached when they landed
    assert sched.remote_prefills.take_releases() == {}
    assert sched.remote_prefills.counters.num_pulls == 1


def test_a_continuation_already_done_on_arrival_releases_its_prefill_side() -> None:
    """Its first token reached max_model_len: it finishes as it is added, with nothing to pull,
    and the prefill side holds nothing for it any more."""
    sched = make_scheduler(block_size=BLOCK, max_model_len=12)
    assert sched.add_request(remote_request("r", 11)) is False
    assert sched.remote_prefills.take_releases() == {"p0": ["r"]}


def test_a_continuation_the_engine_core_refuses_releases_its_prefill_side() -> None:
    """Turned away (invalid here: a prompt past max_model_len; or overloaded, or recovering):
    the prefill side is released all the same."""
    from shoal.bus.messages.engine import AddRequest
    from shoal.config.deployment import CacheConfig, SchedulerConfig
    from shoal.engine.core.engine_core import EngineCore

    core = EngineCore(
        SchedulerConfig(max_num_batched_tokens=64, max_waiting_requests=1),
        CacheConfig(block_size=BLOCK, num_gpu_blocks_override=64),
        num_blocks=64,
        max_model_len=32,
    )
    held = remote_request("x", 10).remote_prefill

    def add(request_id: str, prompt_len: int) -> AddRequest:
        return AddRequest(
            request_id,
            prompt(prompt_len),
            SamplingParams(max_tokens=4),
            "client",
            0.0,
            output_token_ids=[FIRST_TOKEN],
            kv_transfer_params=held,
        )

    assert core.admit(add("too-long", 40)) is None
    assert core.admit(add("overflow", 10)).code == "overloaded"  # type: ignore[union-attr]
    _, rejected = core.apply_inputs()
    assert [r.code for _, r in rejected] == ["invalid"]
    core.turn_away(add("recovering", 10))
    assert core.take_kv_releases() == {"p0": ["overflow", "too-long", "recovering"]}


def test_a_request_admitted_past_half_the_holds_lease_is_not_pulled() -> None:
    """The prefill side frees a hold at its lease's end and may reuse the blocks at once: a
    request that waited past half the lease recomputes instead of reading them."""
    now = [1000.0]
    remote = RemotePrefills(BLOCK, clock=lambda: now[0])
    on_time, late = remote_request("on-time", 10), remote_request("late", 10)
    for request in (on_time, late):
        request.remote_prefill = msgspec.structs.replace(request.remote_prefill, lease_s=60.0)
        remote.track(request)
    now[0] += 29.0
    assert remote.on_admission(on_time, 0) is not None
    now[0] += 2.0  # 31 s: past half of 60
    assert remote.on_admission(late, 0) is None
    assert remote.counters.num_late == 1
    assert remote.take_releases() == {"p0": ["late"]}


def test_a_request_released_without_a_pull_never_pulls_later() -> None:
    """Its local hit covered the remote tokens, so the prefill side was released at admission;
    preempted and evicted later, it recomputes: the released blocks are never read."""
    request = remote_request("r", 10)
    remote = tracked(request)
    assert remote.on_admission(request, 3) is None  # 3 local blocks cover 10 tokens
    assert remote.take_releases() == {"p0": ["r"]}
    assert remote.on_admission(request, 0) is None
