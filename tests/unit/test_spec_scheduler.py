"""Speculative decoding in the pure scheduler: drafts scheduled as extra tokens, rejected ones
rolled back, stops inside an accepted run, K per step; outputs identical to no speculation, with
one and two steps in flight (``spec_fakes.FakeSpecWorker`` plays the worker)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from shoal.config.speculative import SpeculativeConfig
from shoal.engine.core.request import Request
from shoal.engine.core.scheduler import Scheduler
from shoal.engine.core.spec_decoding import SpecDecoding
from tests.unit.factories import (
    FakeWorker,
    Pipeline,
    default_token_for,
    make_request,
    make_requests,
    make_scheduler,
)
from tests.unit.spec_fakes import DraftFor, FakeSpecWorker, oracle, wrong_every
from tests.unit.test_async_scheduling import SCENARIOS, summary


def ngram(k: int = 3, **more: Any) -> SpeculativeConfig:
    return SpeculativeConfig(speculative_method="ngram", num_speculative_tokens=k, **more)


def run(
    depth: int,
    requests: Callable[[], list[Request]],
    token_for: Callable[[str, int], int] = default_token_for,
    spec: SpeculativeConfig | None = None,
    draft_for: DraftFor = oracle,
    **settings: Any,
) -> Pipeline:
    scheduler = make_scheduler(async_scheduling=depth > 1, speculative_config=spec, **settings)
    for request in requests():
        scheduler.add_request(request)
    worker: FakeWorker = (
        FakeWorker(scheduler.block_size, token_for)
        if spec is None
        else FakeSpecWorker(scheduler.block_size, draft_for, token_for)
    )
    pipeline = Pipeline(scheduler, worker, depth)
    pipeline.run()
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.num_blocks - 1
    assert not scheduler.pending_frees
    return pipeline


DRAFTERS: dict[str, DraftFor] = {
    "oracle": oracle,
    "wrong every 3rd": wrong_every(3),
    "always wrong": wrong_every(1),
    "short": lambda request_id, pos: None if pos % 4 == 0 else oracle(request_id, pos),
}


@pytest.mark.parametrize("drafter", list(DRAFTERS))
@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("depth", [1, 2])
def test_outputs_equal_no_speculation(name: str, depth: int, drafter: str) -> None:
    requests, token_for, settings = SCENARIOS[name]
    plain = run(1, requests, token_for, **settings)
    spec = run(depth, requests, token_for, ngram(3), DRAFTERS[drafter], **settings)
    assert summary(spec) == summary(plain)
    stats = spec.scheduler.make_stats()
    if drafter == "oracle" and depth == 1:
        assert stats.spec_decode_num_draft_tokens > 0
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    if drafter == "always wrong":
        assert stats.spec_decode_num_accepted_tokens == 0


def test_oracle_drafts_cut_the_number_of_steps() -> None:
    requests = lambda: make_requests(2, 6, max_tokens=24)  # noqa: E731
    plain = run(1, requests)
    spec = run(1, requests, spec=ngram(3))
    plain_steps, spec_steps = plain.scheduler.step_id, spec.scheduler.step_id
    assert summary(spec) == summary(plain)
    # 1 prefill step, then 4 tokens per step (3 drafts + the bonus) instead of 1.
    assert spec_steps <= 1 + -(-23 // 4) + 1 < plain_steps


def test_rejections_roll_back_and_are_counted() -> None:
    spec = run(1, lambda: [make_request("r", [5, 6, 7], max_tokens=30)], spec=ngram(4),
               draft_for=wrong_every(3))  # fmt: skip
    stats = spec.scheduler.make_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert stats.spec_decode_num_drafts > 0
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    assert len(per_pos) == 4 and sum(per_pos) == stats.spec_decode_num_accepted_tokens
    assert per_pos == sorted(per_pos, reverse=True)  # a run is accepted from its start


def test_drafts_never_pass_max_tokens_or_max_model_len() -> None:
    spec = run(
        1,
        lambda: [
            make_request("a", [5, 6, 7], max_tokens=6),
            make_request("b", list(range(10, 24)), max_tokens=100),
        ],
        spec=ngram(5),
        max_model_len=20,
    )
    outputs = summary(spec)
    assert len(outputs["a"][0]) == 6 and outputs["a"][1] == "length"
    assert len(outputs["b"][0]) == 20 - 14 and outputs["b"][1] == "length"
    # Every scheduled draft could have been emitted: no position past the limits was run.
    assert spec.num_scheduled["a"] == 3 + 6 - 1
    assert spec.num_scheduled["b"] == 20 - 1


def test_a_stop_token_inside_an_accepted_run_drops_the_rest() -> None:
    stop = default_token_for("s", 9)
    requests = lambda: [make_request("s", [3, 4, 5], max_tokens=20, stop_token_ids=[stop])]  # noqa: E731
    plain = run(1, requests)
    spec = run(1, requests, spec=ngram(5))
    assert summary(spec) == summary(plain)
    tokens, reason, stop_reason = summary(spec)["s"]
    assert tokens[-1] == stop and reason == "stop" and stop_reason == stop
    assert len(tokens) == 9 - 3 + 1


def test_the_table_picks_k_by_the_number_of_scheduled_requests() -> None:
    """vLLM's test_dynamic_sd: (1,16,3), (32,128,2), (256,2048,0) → 4 requests: 3, 64: 2,
    256: 0; an empty step keeps K."""
    table = ((1, 16, 3), (32, 128, 2), (256, 2048, 0))
    for num_requests, k in ((4, 3), (64, 2), (256, 0)):
        scheduler = make_scheduler(
            speculative_config=ngram(3, num_speculative_tokens_per_batch_size=table),
            max_num_seqs=256,
            max_num_batched_tokens=256 * 2,
            num_blocks=600,
        )
        for request in make_requests(num_requests, 2, max_tokens=4):
            scheduler.add_request(request)
        step = scheduler.schedule()
        assert len(step.num_scheduled_tokens) == num_requests
        assert step.num_spec_tokens_to_propose == k
        assert step.to_message().num_spec_tokens == k
        assert scheduler.make_stats().spec_decode_k == k


def test_k_from_the_table_keeps_outputs_equal() -> None:
    table = ((1, 2, 4), (3, 100, 1))
    requests, token_for, settings = SCENARIOS["mixed lengths"]
    plain = run(1, requests, token_for, **settings)
    for depth in (1, 2):
        spec = run(depth, requests, token_for,
                   ngram(4, num_speculative_tokens_per_batch_size=table), **settings)  # fmt: skip
        assert summary(spec) == summary(plain)


def test_acceptance_driven_k_drops_when_drafts_fail_and_keeps_outputs() -> None:
    requests = lambda: [make_request("r", [5, 6, 7], max_tokens=120)]  # noqa: E731
    plain = run(1, requests)
    spec = run(1, requests, spec=ngram(4, acceptance_driven_k=True), draft_for=wrong_every(1))
    assert summary(spec) == summary(plain)
    controller = spec.scheduler.spec.controller  # type: ignore[union-attr]
    assert controller is not None and controller.k == 0
    stats = spec.scheduler.make_stats()
    # Far fewer drafts than K=4 every step would have cost (probes only once K reached 0).
    assert stats.spec_decode_num_draft_tokens < 4 * 119 // 3


@pytest.mark.parametrize("depth", [1, 2])
def test_drafts_proposed_before_k_fell_are_not_verified(depth: int) -> None:
    """K = 4 drafts are already proposed when the controller drops K to 0 (by one step, or
    two with a step in flight): the steps after the drop verify none of them; a probe's
    drafts are verified one each."""

    def requests() -> list[Request]:
        return [make_request(f"r{i}", [5, 6, 7 + i], max_tokens=80) for i in range(4)]

    scheduler = make_scheduler(
        async_scheduling=depth > 1, speculative_config=ngram(4, acceptance_driven_k=True)
    )
    for request in requests():
        scheduler.add_request(request)
    pipeline = Pipeline(scheduler, FakeSpecWorker(scheduler.block_size, wrong_every(1)), depth)
    controller = scheduler.spec.controller  # type: ignore[union-attr]
    assert controller is not None
    schedule = pipeline.schedule
    verified_after_drop: list[int] = []  # per step scheduled once K was 0

    def watching_schedule() -> Any:
        k_before = controller.k
        step = schedule()
        if step is not None and k_before == 0:
            verified_after_drop.append(max(step.num_spec_tokens.values(), default=0))
        return step

    pipeline.schedule = watching_schedule  # type: ignore[method-assign]
    pipeline.run()
    assert summary(pipeline) == summary(run(depth, requests))
    assert controller.k == 0 and len(verified_after_drop) > 20
    assert max(verified_after_drop) == 1  # probes only, one draft each
    assert verified_after_drop.count(1) <= 4


def test_preempted_requests_drop_their_drafts() -> None:
    scheduler: Scheduler = run(
        1, SCENARIOS["preemption"][0], spec=ngram(3), num_blocks=12
    ).scheduler
    assert scheduler.num_preemptions > 0


def test_async_scheduling_verifies_drafts_it_has_not_seen_yet() -> None:
    """With two steps in flight, a request is scheduled again (with K placeholder drafts) before
    the step that proposes its drafts lands, so the worker is never left idle."""
    requests = lambda: [make_request("r", [5, 6, 7], max_tokens=40)]  # noqa: E731
    scheduler = make_scheduler(async_scheduling=True, speculative_config=ngram(3))
    for request in requests():
        scheduler.add_request(request)
    pipeline = Pipeline(scheduler, FakeSpecWorker(scheduler.block_size), 2)
    in_flight_at_schedule: list[int] = []
    schedule = pipeline.schedule

    def counting_schedule() -> Any:
        in_flight_at_schedule.append(len(pipeline.outstanding))
        return schedule()

    pipeline.schedule = counting_schedule  # type: ignore[method-assign]
    pipeline.run()
    assert summary(pipeline) == summary(run(1, requests))
    overlapped = in_flight_at_schedule.count(1)
    stats = scheduler.make_stats()
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    assert overlapped >= scheduler.step_id - 2


def test_a_landing_step_does_not_overwrite_newer_placeholders() -> None:
    spec = SpecDecoding(ngram(3), max_num_seqs=4, max_model_len=64)
    request = make_request("r", [1, 2, 3])
    request.spec_token_ids = [-1, -1, -1]  # booked by a later step still in flight
    request.num_in_flight_steps = 1
    spec.take_drafts(request, [7, 8])
    assert request.spec_token_ids == [-1, -1, -1]
    request.num_in_flight_steps = 0
    spec.take_drafts(request, [7, 8])
    assert request.spec_token_ids == [7, 8]


def test_a_draft_model_gets_lookahead_slots_for_its_own_kv() -> None:
    config = SpeculativeConfig(
        speculative_method="draft_model", num_speculative_tokens=3, speculative_model="/draft"
    )
    scheduler = make_scheduler(speculative_config=config, block_size=4)
    scheduler.add_request(make_request("r", list(range(10, 18)), max_tokens=50))
    step = scheduler.schedule()  # the prompt (8 tokens) + 3 lookahead: 11 slots, 3 blocks
    assert step.num_scheduled_tokens["r"] == 8
    assert len(scheduler.get_block_ids("r")) == 3
    result = FakeSpecWorker(4).execute(step.to_message())
    scheduler.update_from_output(step, result)
    step = scheduler.schedule()  # 1 + 3 drafts from position 8, + 3 lookahead: up to 15
    assert step.num_scheduled_tokens["r"] == 4 and step.num_spec_tokens == {"r": 3}
    assert len(scheduler.get_block_ids("r")) == 4
