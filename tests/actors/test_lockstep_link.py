"""The engine cores' lock-step link on its own, on the in-memory bus and on a real nats-server:
two ranks agree on every round, a rank with nothing to do is woken to join a round, a restarted
rank catches up, a round a peer never reports ends in ``LockstepTimeout``, and the ranks agree
on the epoch of a rebuilt expert-parallel group (a rank waiting on a round gives it up at once
when another rebuilds)."""

from __future__ import annotations

import asyncio

import pytest

from shoal.bus.subjects import Subjects
from shoal.engine.actor.lockstep_link import LockstepLink, LockstepTimeout
from shoal.engine.actor.worker_link import WorkerFailure
from shoal.engine.core.lockstep import RoundOutcome
from tests.integration.conditions import wait_for

pytestmark = [pytest.mark.timeout(60), pytest.mark.asyncio]
# A round's bound: generous, as nothing here is timed and CI machines can be loaded (one run
# with a benchmark on both cores missed a 5 s bound over NATS).
ROUND_S = 20.0
SUBJECTS = Subjects("lockstep-test")


async def make_links(bus_factory, wakes: list[int]) -> list[LockstepLink]:  # type: ignore[no-untyped-def]
    links = []
    for rank in range(2):
        bus = await bus_factory()
        link = LockstepLink(bus, SUBJECTS, rank, 2, lambda rank=rank: wakes.append(rank))
        await link.start()
        links.append(link)
    return links


async def test_two_ranks_agree_and_an_idle_rank_is_woken(bus_factory) -> None:  # type: ignore[no-untyped-def]
    wakes: list[int] = []
    a, b = await make_links(bus_factory, wakes)
    both = await asyncio.gather(a.agree(3, ROUND_S), b.agree(0, ROUND_S))
    assert both == [RoundOutcome(0, (3, 0))] * 2
    busy = asyncio.create_task(a.agree(0, ROUND_S))  # rank 1 has nothing to do ...
    await wait_for(lambda: b.peer_waiting, ROUND_S, "rank 0's report")
    assert 1 in wakes  # ... until rank 0 reports: it is woken to join
    assert await b.agree(0, ROUND_S) == await busy == RoundOutcome(1, (0, 0))
    assert not (await busy).runs
    restarted = LockstepLink(b.bus, SUBJECTS, 1, 2, lambda: None)  # rank 1 starts over at 0
    await b.stop()
    await restarted.start()
    both = await asyncio.gather(a.agree(1, ROUND_S), restarted.agree(2, ROUND_S))
    assert both == [RoundOutcome(2, (1, 2))] * 2


async def test_a_round_a_peer_never_reports_times_out(bus_factory) -> None:  # type: ignore[no-untyped-def]
    a, _ = await make_links(bus_factory, [])
    with pytest.raises(LockstepTimeout, match="round 0"):
        await a.agree(4, 0.2)
    assert a.rounds.pending is None and a.rounds.next_round == 0  # withdrawn: round 0 again


async def test_the_engine_cores_agree_on_the_epoch_of_a_rebuilt_group(bus_factory) -> None:  # type: ignore[no-untyped-def]
    wakes: list[int] = []
    a, b = await make_links(bus_factory, wakes)
    first = await asyncio.gather(a.agree_group_epoch(ROUND_S), b.agree_group_epoch(ROUND_S))
    assert first == ["experts-1-"] * 2  # make_links gives no nonce
    busy = asyncio.create_task(a.agree(3, ROUND_S))  # a waits on a round ...
    await wait_for(lambda: b.peer_waiting, ROUND_S, "a's report")
    rebuilding = asyncio.create_task(b.agree_group_epoch(ROUND_S))  # ... when b rebuilds the group
    with pytest.raises(WorkerFailure, match="rebuilds the group"):
        await busy  # a gives up the round at once, not after its timeout
    assert a.group_broken and 0 in wakes
    assert await asyncio.gather(a.agree_group_epoch(ROUND_S), rebuilding) == ["experts-2-"] * 2
    assert not a.group_broken and not b.group_broken
