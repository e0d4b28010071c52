"""The engine core's offload connector through the pure scheduler: lookups park a request without
blocking others, hits load into fresh blocks on the admitting step, landed chunks are stored,
failed loads recompute, nothing leaks (pins, block references) — with outputs equal to offload
off, checked by a fake worker that verifies every KV slot attention reads."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.bus.messages.offload import TierLookupReply
from shoal.engine.core.request import RequestStatus
from tests.unit.factories import FakeWorker, make_request, make_scheduler, run_to_completion
from tests.unit.offload_fakes import (
    GENERATION,
    Exchange,
    FakeTier,
    OffloadWorker,
    drive,
    make_offload_scheduler,
    region_for,
)

PROMPT = list(range(100, 113))  # 13 tokens: 3 full blocks of 4


def setup(num_slots: int = 64, delay: int = 0, bpc: int = 1, **options):
    scheduler = make_offload_scheduler(blocks_per_chunk=bpc, **options)
    assert scheduler.connector is not None
    scheduler.connector.region = region_for(scheduler, num_slots)
    tier = FakeTier(num_slots)
    worker = OffloadWorker(scheduler.block_size, tier, bpc)
    return scheduler, tier, worker, Exchange(scheduler, tier, delay)


def reference(prompts: dict[str, list[int]], max_tokens: int = 4) -> dict[str, list[int]]:
    scheduler = make_scheduler(block_size=4, num_blocks=65)
    for request_id, prompt in prompts.items():
        scheduler.add_request(make_request(request_id, prompt, max_tokens=max_tokens))
    outputs = run_to_completion(scheduler, FakeWorker(4))
    return {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in outputs.items()}


def run_one(scheduler, worker, exchange, request_id, prompt, max_tokens=4):
    scheduler.add_request(make_request(request_id, prompt, max_tokens=max_tokens))
    return drive(scheduler, worker, exchange)[request_id]


def test_a_returning_prefix_loads_from_the_tier_instead_of_recomputing() -> None:
    scheduler, tier, worker, exchange = setup()
    first = run_one(scheduler, worker, exchange, "a", PROMPT)
    assert tier.manager.num_used_slots == 3  # the prompt's three full blocks
    assert scheduler.reset_prefix_cache()  # the local cache forgets them
    again = run_one(scheduler, worker, exchange, "b", PROMPT)
    assert worker.num_loaded_blocks == 3
    assert scheduler.connector is not None
    assert scheduler.connector.counters.num_hit_tokens == 12
    assert again == reference({"b": PROMPT})["b"]
    assert first == reference({"a": PROMPT})["a"]
    assert tier.num_pinned == 0 and all(c.ref_cnt == 0 for c in tier.manager.chunks.values())


def test_the_loaded_request_computes_only_its_last_token() -> None:
    scheduler, _tier, worker, exchange = setup()
    run_one(scheduler, worker, exchange, "a", PROMPT)
    scheduler.reset_prefix_cache()
    scheduler.add_request(make_request("b", PROMPT, max_tokens=2))
    scheduler.schedule()  # parks b, sends its lookup
    exchange()
    step = scheduler.schedule()
    assert step.num_scheduled_tokens == {"b": 1}
    assert step.kv_transfers is not None and [load.req_id for load in step.kv_transfers.loads] == [
        "b"
    ]
    assert step.requests["b"].num_cached_tokens == 12


def test_a_parked_request_does_not_block_the_ones_behind_it() -> None:
    scheduler, _tier, _worker, _exchange = setup(delay=100)
    scheduler.add_request(make_request("long", PROMPT, max_tokens=2))
    scheduler.add_request(make_request("short", [7, 8], max_tokens=2))
    step = scheduler.schedule()
    assert set(step.num_scheduled_tokens) == {"short"}
    assert scheduler.connector is not None and set(scheduler.connector.parked) == {"long"}
    assert scheduler.num_waiting == 1


def test_an_abort_while_parked_releases_the_pins_of_the_late_answer() -> None:
    scheduler, tier, worker, exchange = setup()
    run_one(scheduler, worker, exchange, "a", PROMPT)
    scheduler.reset_prefix_cache()
    scheduler.add_request(make_request("b", PROMPT, max_tokens=2))
    scheduler.schedule()
    connector = scheduler.connector
    assert connector is not None
    ((request_id, lookup_id, keys, tiers),) = connector.lookups_to_send
    assert tiers is None  # the request names no kv_load_tiers
    scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    reply = tier.lookup(keys)
    assert tier.num_pinned == 3
    assert connector.on_lookup_reply(request_id, lookup_id, keys, reply) is None
    exchange()
    assert tier.num_pinned == 0 and not connector.parked


def test_a_failed_load_recomputes_and_its_blocks_are_never_trusted() -> None:
    scheduler, tier, worker, exchange = setup()
    run_one(scheduler, worker, exchange, "a", PROMPT)
    scheduler.reset_prefix_cache()
    worker.fail_loads.add("b")
    # b's load fails; c, admitted after b's blocks were given back, must not hit them.
    assert run_one(scheduler, worker, exchange, "b", PROMPT) == reference({"b": PROMPT})["b"]
    assert worker.num_loaded_blocks == 0
    assert scheduler.connector is not None and scheduler.connector.counters.num_hit_tokens == 0
    assert tier.num_pinned == 0


def test_a_request_admitted_beside_a_failed_load_never_reads_its_blocks() -> None:
    """b and c share a prompt; b's load fails in the step both are admitted in: c must have
    loaded its own copy (b's blocks are not a prefix-cache hit before b's load landed)."""
    scheduler, _tier, worker, exchange = setup()
    run_one(scheduler, worker, exchange, "a", PROMPT)
    scheduler.reset_prefix_cache()
    worker.fail_loads.add("b")
    scheduler.add_request(make_request("b", PROMPT, max_tokens=3))
    scheduler.add_request(make_request("c", PROMPT, max_tokens=3))
    got = drive(scheduler, worker, exchange)
    assert got == reference({"b": PROMPT, "c": PROMPT}, 3)
    assert worker.num_loaded_blocks == 3  # c's


def test_a_lookup_answered_by_another_generation_is_not_used_and_asked_again() -> None:
    """Slots named by another generation of the tier are never loaded; the request asks the
    current tier again (which holds a's chunks) and loads those."""
    scheduler, tier, worker, exchange = setup()
    run_one(scheduler, worker, exchange, "a", PROMPT)
    scheduler.reset_prefix_cache()
    scheduler.add_request(make_request("b", PROMPT, max_tokens=2))
    scheduler.schedule()
    connector = scheduler.connector
    assert connector is not None
    ((request_id, lookup_id, keys, _),) = connector.lookups_to_send
    connector.lookups_to_send.clear()
    stale = TierLookupReply("another-" + GENERATION, [50, 51, 52])  # slots a's are not in
    scheduler.unpark(connector.on_lookup_reply(request_id, lookup_id, keys, stale))
    assert drive(scheduler, worker, exchange)["b"] == reference({"b": PROMPT}, 2)["b"]
    assert worker.num_loaded_blocks == 3 and tier.num_pinned == 0


def test_a_tier_restart_voids_what_the_old_one_granted() -> None:
    """b's answer (pinned by generation 1) and a store granted by generation 1 are not used
    once the engine core attached to generation 2: b looks up again in the new, empty tier
    and recomputes; nothing is reported to the new tier for the old grants."""
    scheduler, _tier, worker, exchange = setup()
    run_one(scheduler, worker, exchange, "a", PROMPT)
    scheduler.reset_prefix_cache()
    scheduler.add_request(make_request("b", PROMPT, max_tokens=2))
    scheduler.schedule()
    exchange()  # b answered by generation 1: 3 chunks pinned
    connector = scheduler.connector
    assert connector is not None and connector.held_keys()
    new_tier = FakeTier(64, generation="gen-2")
    connector.set_region(msgspec.structs.replace(connector.region, generation="gen-2"))
    assert connector.held_keys() == []  # nothing of generation 1 is renewed any more
    worker.tier, exchange.tier = new_tier, new_tier
    assert drive(scheduler, worker, exchange)["b"] == reference({"b": PROMPT}, 2)["b"]
    assert worker.num_loaded_blocks == 0  # never loaded generation 1's slots
    assert new_tier.num_pinned == 0 and new_tier.manager.num_used_slots == 3  # b's, stored


def test_a_reply_for_a_finished_request_is_not_given_to_a_new_one_with_its_id() -> None:
    scheduler, tier, worker, exchange = setup()
    run_one(scheduler, worker, exchange, "a", PROMPT)
    scheduler.reset_prefix_cache()
    connector = scheduler.connector
    assert connector is not None
    scheduler.add_request(make_request("x", PROMPT, max_tokens=2))
    scheduler.schedule()
    ((_, first_lookup, first_keys, _),) = connector.lookups_to_send
    connector.lookups_to_send.clear()
    scheduler.finish_requests("x", RequestStatus.FINISHED_ABORTED)
    other = list(range(500, 513))
    scheduler.add_request(make_request("x", other, max_tokens=2))  # the id, reused
    scheduler.schedule()
    late = tier.lookup(first_keys)  # the first lookup's answer arrives now: a's chunks, pinned
    assert connector.on_lookup_reply("x", first_lookup, first_keys, late) is None
    assert set(connector.parked) == {"x"}  # the new x still waits for its own answer
    assert drive(scheduler, worker, exchange)["x"] == reference({"x": other}, 2)["x"]
    assert worker.num_loaded_blocks == 0 and tier.num_pinned == 0


def test_stores_give_way_past_the_backlog_and_outputs_stay_right() -> None:
    scheduler, tier, worker, exchange = setup(max_pending_store_chunks=2)
    assert run_one(scheduler, worker, exchange, "a", PROMPT) == reference({"a": PROMPT})["a"]
    assert scheduler.connector is not None
    assert scheduler.connector.stores.num_skipped == 3
    assert tier.manager.num_used_slots == 0


@pytest.mark.parametrize(
    ("prompt_only", "policy", "expected_offers"),
    [(True, "chunk_level", 1), (False, "chunk_level", 2), (True, "request_level", 2)],
)
def test_which_chunks_are_offered(prompt_only: bool, policy: str, expected_offers: int) -> None:
    """b's first block is a local hit; its 9 prompt tokens fill 2 blocks, and with its outputs
    (the last one's KV never computed) 13 tokens fill 3."""
    scheduler, _tier, worker, exchange = setup(
        offload_prompt_only=prompt_only, offload_policy=policy
    )
    run_one(scheduler, worker, exchange, "a", [1, 2, 3, 4, 5], max_tokens=1)
    num_offered = len(exchange.offered)
    run_one(scheduler, worker, exchange, "b", [1, 2, 3, 4, 9, 9, 9, 9, 9], max_tokens=5)
    assert len(exchange.offered) - num_offered == expected_offers


def test_a_fault_gives_back_every_pin_and_block() -> None:
    scheduler, tier, worker, exchange = setup(delay=1)
    run_one(scheduler, worker, exchange, "a", PROMPT)
    scheduler.reset_prefix_cache()
    scheduler.add_request(make_request("b", PROMPT, max_tokens=8))
    scheduler.add_request(make_request("c", list(range(300, 330)), max_tokens=8))
    for _ in range(3):
        step = scheduler.schedule()
        exchange()
        if not step.is_empty:
            scheduler.update_from_output(step, worker.execute(step.to_message()))
        exchange()
    assert scheduler.connector is not None
    scheduler.connector.abandon()
    scheduler.finish_requests(None, RequestStatus.FINISHED_ERROR)
    exchange()
    assert scheduler.reset_prefix_cache()  # no block is still held for a store
    assert tier.num_pinned == 0
    assert all(chunk.is_ready for chunk in tier.manager.chunks.values())


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    bpc=st.sampled_from([1, 2]),
    num_blocks=st.integers(min_value=12, max_value=40),
    num_slots=st.integers(min_value=2, max_value=30),
    delay=st.integers(min_value=0, max_value=2),
)
def test_outputs_equal_offload_off_under_random_traffic(data, bpc, num_blocks, num_slots, delay):
    """Shared prefixes, a pool small enough to evict, a tier small enough to evict, late
    answers: every request's tokens equal offload off; nothing stays pinned or held."""
    scheduler = make_offload_scheduler(
        num_blocks=num_blocks,
        blocks_per_chunk=bpc,
        offload_prompt_only=data.draw(st.booleans()),
        async_scheduling=data.draw(st.booleans()),  # blocks cached once landed, not allocated
    )
    assert scheduler.connector is not None
    scheduler.connector.region = region_for(scheduler, num_slots)
    tier = FakeTier(num_slots, data.draw(st.sampled_from(["lru", "arc"])))
    worker = OffloadWorker(4, tier, bpc)
    exchange = Exchange(scheduler, tier, delay)
    prefixes = [list(range(200, 216)), list(range(400, 408))]
    prompts = {}
    for index in range(data.draw(st.integers(min_value=2, max_value=6))):
        prefix = prefixes[data.draw(st.integers(min_value=0, max_value=1))]
        tail = data.draw(st.lists(st.integers(min_value=3, max_value=90), max_size=7))
        prompts[f"r{index}"] = prefix + tail
    for wave in (0, 1):  # the second wave returns after the first finished
        for request_id, prompt in prompts.items():
            rid = f"{request_id}-{wave}"
            scheduler.add_request(make_request(rid, prompt, max_tokens=3))
        got = drive(scheduler, worker, exchange)
        want = reference({f"{r}-{wave}": p for r, p in prompts.items()}, 3)
        assert got == want
        if wave == 0 and data.draw(st.booleans()):
            scheduler.reset_prefix_cache()
    assert tier.num_pinned == 0
    assert all(chunk.ref_cnt == 0 for chunk in tier.manager.chunks.values())
    assert scheduler.kv_cache_manager.num_free_blocks == num_blocks - 1


def test_held_keys_are_the_pins_and_stores_not_given_back_yet() -> None:
    """What the engine core renews at the tier: an answer not loaded yet, a load in flight, a
    store not copied yet; nothing once each is given back."""
    scheduler, _tier, worker, exchange = setup()
    connector = scheduler.connector
    assert connector is not None
    scheduler.add_request(make_request("a", PROMPT, max_tokens=1))
    step = scheduler.schedule()
    exchange()  # a miss: a recomputes
    step = scheduler.schedule()
    assert connector.held_keys() == []
    scheduler.update_from_output(step, worker.execute(step.to_message()))
    ((_, offered),) = connector.stores.offers_to_send
    assert connector.held_keys() == offered  # blocks held for a store, slots not known yet
    exchange()
    step = scheduler.schedule()  # the copy rides on this (copy-only) step
    assert step.kv_transfers is not None and connector.held_keys() == offered
    scheduler.update_from_output(step, worker.execute(step.to_message()))
    assert connector.held_keys() == []
    scheduler.reset_prefix_cache()
    scheduler.add_request(make_request("b", PROMPT, max_tokens=1))
    scheduler.schedule()
    exchange()  # answered: pinned until loaded
    assert connector.held_keys() == offered
    step = scheduler.schedule()
    assert connector.held_keys() == offered  # loading in this step
    scheduler.update_from_output(step, worker.execute(step.to_message()))
    assert connector.held_keys() == []
