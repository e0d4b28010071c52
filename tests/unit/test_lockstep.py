"""The lock-step rounds of engine cores (``engine/core/lockstep.py``): every rank reaches the
same outcome for every round whatever the delivery order, an idle rank is told to join, and a
restarted rank catches up through hints."""

from __future__ import annotations

import random
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.bus.messages.lockstep import (
    LockstepHint,
    LockstepMessage,
    LockstepReport,
    LockstepWithdraw,
)
from shoal.engine.core.lockstep import Lockstep, RoundOutcome


def test_a_round_runs_when_any_rank_has_tokens() -> None:
    a, b = Lockstep(0, 2), Lockstep(1, 2)
    ra, rb = a.report(5), b.report(0)
    assert a.take_outcome() is None  # b's report not in yet
    a.receive(rb)
    b.receive(ra)
    assert a.take_outcome() == b.take_outcome() == RoundOutcome(0, (5, 0))
    assert RoundOutcome(0, (5, 0)).runs and not RoundOutcome(1, (0, 0)).runs
    assert a.next_round == b.next_round == 1


def test_an_idle_rank_is_told_to_join_and_a_report_one_round_ahead_is_kept() -> None:
    a, b = Lockstep(0, 2), Lockstep(1, 2)
    assert not b.peer_waiting
    b.receive(a.report(3))
    assert b.peer_waiting
    a.receive(b.report(0))
    assert b.take_outcome() == a.take_outcome() == RoundOutcome(0, (3, 0))
    b.receive(a.report(1))  # a is on round 1 before b has reported it
    assert b.peer_waiting
    assert b.receive(LockstepReport(0, 1, 1)) == []  # a repeat is harmless
    a.receive(b.report(2))
    assert a.take_outcome() == b.take_outcome() == RoundOutcome(1, (1, 2))


def test_a_restarted_rank_catches_up_through_a_hint() -> None:
    a, b = Lockstep(0, 2), Lockstep(1, 2)
    for _ in range(3):  # rounds 0..2
        a.receive(b.report(1))
        b.receive(a.report(1))
        assert a.take_outcome() == b.take_outcome()
    b = Lockstep(1, 2)  # b restarts at round 0
    (hint,) = a.receive(b.report(4))
    assert hint == LockstepHint(0, 3)
    (moved,) = b.receive(hint)
    assert moved == LockstepReport(1, 3, 4)
    a.receive(moved)
    b.receive(a.report(0))
    assert a.take_outcome() == b.take_outcome() == RoundOutcome(3, (0, 4))


def test_a_hint_carries_the_pending_report_a_restarted_rank_missed() -> None:
    a, b = Lockstep(0, 2), Lockstep(1, 2)
    for _ in range(3):
        a.receive(b.report(1))
        b.receive(a.report(1))
        assert a.take_outcome() == b.take_outcome()
    a.report(2)  # a waits on round 3; its report went out before b restarted
    b = Lockstep(1, 2)
    answers = a.receive(b.report(4))
    assert answers == [LockstepHint(0, 3), LockstepReport(0, 3, 2)]
    for answer in answers:
        for moved in b.receive(answer):
            a.receive(moved)
    assert a.take_outcome() == b.take_outcome() == RoundOutcome(3, (2, 4))


def test_a_rank_far_behind_moves_its_pending_report_forward() -> None:
    a = Lockstep(0, 2)
    a.report(2)
    assert a.receive(LockstepReport(1, 7, 0)) == [LockstepReport(0, 7, 2)]
    assert a.take_outcome() == RoundOutcome(7, (2, 0))


def test_abandon_withdraws_the_report_from_every_peer() -> None:
    a, b = Lockstep(0, 2), Lockstep(1, 2)
    b.receive(a.report(2))
    withdrawn = a.abandon()
    assert withdrawn == LockstepWithdraw(0, 0)
    assert a.next_round == 0 and a.pending is None and not a.peer_waiting
    assert b.peer_waiting
    b.receive(withdrawn)
    assert not b.peer_waiting  # b would not run round 0 on a's withdrawn tokens
    b.receive(a.report(6))
    a.receive(b.report(0))
    assert a.take_outcome() == b.take_outcome() == RoundOutcome(0, (6, 0))


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError):
        Lockstep(2, 2)
    a = Lockstep(0, 2)
    with pytest.raises(ValueError):
        a.report(-1)
    a.report(0)
    with pytest.raises(RuntimeError):
        a.report(0)
    with pytest.raises(ValueError):
        a.receive(LockstepReport(5, 0, 0))


class Group:
    """``size`` ranks whose messages travel on per-sender FIFO channels (the bus's order)."""

    def __init__(self, size: int, rng: random.Random) -> None:
        self.ranks = [Lockstep(r, size) for r in range(size)]
        self.channels: list[deque[tuple[int, LockstepMessage]]] = [deque() for _ in range(size)]
        self.outcomes: list[list[RoundOutcome]] = [[] for _ in range(size)]
        self.rng = rng

    def publish(self, sender: int, messages: list[LockstepMessage]) -> None:
        for message in messages:
            for dest in range(len(self.ranks)):
                if dest != sender:
                    self.channels[sender].append((dest, message))

    def deliver_one(self) -> bool:
        busy = [c for c in self.channels if c]
        if not busy:
            return False
        dest, message = self.rng.choice(busy).popleft()
        self.publish(dest, self.ranks[dest].receive(message))
        return True

    def act(self, rank: int, has_work: bool) -> None:
        node = self.ranks[rank]
        if node.pending is None and (has_work or node.peer_waiting):
            self.publish(rank, [node.report(self.rng.randint(0, 3) if has_work else 0)])
        if (outcome := node.take_outcome()) is not None:
            self.outcomes[rank].append(outcome)


@settings(max_examples=60, deadline=None)
@given(size=st.integers(2, 4), seed=st.integers(0, 10_000))
def test_every_rank_sees_the_same_rounds_in_any_delivery_order(size: int, seed: int) -> None:
    rng = random.Random(seed)
    group = Group(size, rng)
    for _ in range(400):
        if rng.random() < 0.5 and group.deliver_one():
            continue
        group.act(rng.randrange(size), has_work=rng.random() < 0.3)
    for _ in range(2000):  # drain: no new work, everyone joins what is pending
        for rank in range(size):
            group.act(rank, has_work=False)
        if not group.deliver_one() and all(r.pending is None for r in group.ranks):
            break
    assert all(r.pending is None for r in group.ranks), "a round never finished"
    first = group.outcomes[0]
    assert all(outcomes == first for outcomes in group.outcomes)
    assert [o.round for o in first] == list(range(len(first)))
