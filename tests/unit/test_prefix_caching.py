"""Prefix caching through the scheduler: hits, partial hits, salts, and cross-process hashes."""

from __future__ import annotations

from shoal.engine.core.scheduler import Scheduler
from tests.unit.factories import (
    FakeWorker,
    make_request,
    make_scheduler,
    run_in_fresh_python,
    run_to_completion,
)


def admit_after(
    scheduler: Scheduler, worker: FakeWorker, first: list[int], second: list[int], **kw
):  # type: ignore[no-untyped-def]
    """Run ``first`` to completion, then schedule ``second``; return its NewRequestData."""
    scheduler.add_request(make_request("first", first, max_tokens=2, **kw.get("first_kw", {})))
    run_to_completion(scheduler, worker)
    scheduler.add_request(make_request("second", second, max_tokens=2, **kw.get("second_kw", {})))
    output = scheduler.schedule()
    scheduler.update_from_output(output, worker.execute(output.to_message()))
    (new,) = output.new_requests
    return new


def test_identical_prompt_hits_every_full_block_but_computes_the_last_token() -> None:
    scheduler, worker = make_scheduler(), FakeWorker(4)
    prompt = list(range(100, 116))  # 4 full blocks
    new = admit_after(scheduler, worker, prompt, prompt)
    assert new.num_computed_tokens == 12  # capped at num_tokens - 1, block aligned
    assert new.num_scheduled_tokens == 4
    stats = scheduler.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (32, 12)


def test_shared_prefix_hits_up_to_the_last_full_shared_block() -> None:
    scheduler, worker = make_scheduler(), FakeWorker(4)
    shared = list(range(100, 110))  # 2 full blocks + 2 tokens
    new = admit_after(scheduler, worker, [*shared, 1, 2, 3], [*shared, 7, 8, 9, 10])
    assert new.num_computed_tokens == 8
    assert scheduler.requests["second"].num_cached_tokens == 8


def test_different_cache_salt_misses_and_same_salt_hits() -> None:
    prompt = list(range(100, 116))
    scheduler, worker = make_scheduler(), FakeWorker(4)
    salted = {"first_kw": {"cache_salt": "a"}, "second_kw": {"cache_salt": "b"}}
    assert admit_after(scheduler, worker, prompt, prompt, **salted).num_computed_tokens == 0
    scheduler, worker = make_scheduler(), FakeWorker(4)
    same = {"first_kw": {"cache_salt": "a"}, "second_kw": {"cache_salt": "a"}}
    assert admit_after(scheduler, worker, prompt, prompt, **same).num_computed_tokens == 12
    scheduler, worker = make_scheduler(), FakeWorker(4)
    unsalted = {"first_kw": {"cache_salt": "a"}}
    assert admit_after(scheduler, worker, prompt, prompt, **unsalted).num_computed_tokens == 0


def test_caching_off_never_hits() -> None:
    scheduler, worker = make_scheduler(enable_prefix_caching=False), FakeWorker(4)
    prompt = list(range(100, 116))
    assert admit_after(scheduler, worker, prompt, prompt).num_computed_tokens == 0
    assert scheduler.make_stats().prefix_cache_hits == 0


def test_generated_tokens_are_cached_too() -> None:
    """A follow-up turn (prompt = earlier prompt + its output) hits the output's blocks."""
    scheduler, worker = make_scheduler(), FakeWorker(4)
    scheduler.add_request(
        make_request("turn1", list(range(100, 106)), max_tokens=8, ignore_eos=True)
    )
    outputs = run_to_completion(scheduler, worker)
    generated = [t for o in outputs["turn1"] for t in o.new_token_ids]
    follow_up = list(range(100, 106)) + generated + [1, 2]
    scheduler.add_request(make_request("turn2", follow_up, max_tokens=1))
    output = scheduler.schedule()
    worker.execute(output.to_message())  # the fake worker checks the hit blocks' contents
    # 6 + 8 tokens; the last generated token was never computed, so 13 are cached: 3 blocks.
    assert output.new_requests[0].num_computed_tokens == 12


def test_outputs_are_the_same_with_and_without_prefix_caching() -> None:
    def run(caching: bool) -> dict[str, list[int]]:
        scheduler = make_scheduler(enable_prefix_caching=caching, max_num_batched_tokens=24)
        shared = list(range(100, 114))
        for index in range(6):
            scheduler.add_request(make_request(f"r{index}", shared + [index] * (index + 1)))
        outputs = run_to_completion(scheduler, FakeWorker(4))
        return {k: [t for o in v for t in o.new_token_ids] for k, v in outputs.items()}

    assert run(True) == run(False)


def test_block_hashes_of_a_scheduled_request_match_across_processes() -> None:
    code = (
        "from tests.unit.factories import make_request, make_scheduler\n"
        "s = make_scheduler(block_size=16)\n"
        "r = make_request('x', list(range(1000, 1100)), cache_salt='t')\n"
        "s.add_request(r)\n"
        "print(','.join(h.hex() for h in r.block_hashes))\n"
    )
    runs = {run_in_fresh_python(code, seed) for seed in ("0", "random")}
    assert len(runs) == 1
    (hashes,) = runs
    assert len(hashes.split(",")) == 6
