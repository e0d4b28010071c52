"""The engine cores' agreement on rebuilding their workers' expert-parallel group
(``engine/core/group_rejoin.py``): every rank agrees on one generation whatever the order of
proposals, a rank that restarted or subscribed late catches up, and a rank that is not
rebuilding learns that the group is going away."""

from __future__ import annotations

import random
from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.bus.messages.lockstep import LockstepRejoin
from shoal.engine.core.group_rejoin import GroupRejoin


def exchange(ranks: list[GroupRejoin], outbox: list[LockstepRejoin], rng: random.Random) -> None:
    """Deliver every message (and the answers) to every other rank, per-sender in order."""
    channels: list[deque[LockstepRejoin]] = [deque() for _ in ranks]
    for message in outbox:
        channels[message.rank].append(message)
    while any(channels):
        sender = rng.choice([i for i, c in enumerate(channels) if c])
        message = channels[sender].popleft()
        for node in ranks:
            if node.rank != sender:
                for answer in node.receive(message):
                    channels[answer.rank].append(answer)


def test_the_first_build_agrees_on_generation_one() -> None:
    a, b = GroupRejoin(0, 2), GroupRejoin(1, 2)
    exchange([a, b], [a.propose(), b.propose()], random.Random(0))
    assert a.take_generation() == b.take_generation() == 1
    assert a.joined == b.joined == 1 and not a.peer_rebuilding


def test_a_rank_that_subscribed_late_still_hears_the_proposal() -> None:
    a, b = GroupRejoin(0, 2), GroupRejoin(1, 2)
    a.propose()  # went out before b listened: b never got it
    (answer,) = a.receive(b.propose())  # a hears b for the first time: it says its own again
    assert answer == LockstepRejoin(0, 1)
    (echo,) = b.receive(answer)  # b hears a first time too: says its own once more
    assert a.receive(echo) == []  # and that is the end of it
    assert a.take_generation() == b.take_generation() == 1


def test_echoes_after_the_build_do_not_break_it() -> None:
    a, b = GroupRejoin(0, 2), GroupRejoin(1, 2)
    pa, pb = a.propose(), b.propose()
    (echo,) = a.receive(pb)  # a hears b first time: says its own again
    assert a.take_generation() == 1
    b.receive(pa)
    assert b.take_generation() == 1
    (told,) = b.receive(echo)  # a late copy of generation 1: b tells its generation ...
    assert told == LockstepRejoin(1, 1, proposing=False) and not b.peer_rebuilding
    assert a.receive(told) == [] and not a.peer_rebuilding  # ... which changes nothing


def test_a_rank_not_rebuilding_learns_the_group_goes_away_and_joins_the_next() -> None:
    a, b = GroupRejoin(0, 2), GroupRejoin(1, 2)
    exchange([a, b], [a.propose(), b.propose()], random.Random(0))
    a.take_generation(), b.take_generation()
    exchange([a, b], [b.propose()], random.Random(0))  # b's worker died: b's retry proposes 2
    assert a.peer_rebuilding and b.take_generation() is None
    exchange([a, b], [a.propose()], random.Random(0))  # a faults, its retry proposes 2 too
    assert a.take_generation() == b.take_generation() == 2
    assert not a.peer_rebuilding and not b.peer_rebuilding


def test_a_restarted_rank_is_told_the_generation_and_proposes_past_it() -> None:
    a, b = GroupRejoin(0, 2), GroupRejoin(1, 2)
    for _ in range(3):
        exchange([a, b], [a.propose(), b.propose()], random.Random(0))
        a.take_generation(), b.take_generation()
    b = GroupRejoin(1, 2)  # b's engine core restarts: it knows no generation
    (told,) = a.receive(b.propose())  # b proposes 1: a is in 3
    assert told == LockstepRejoin(0, 3, proposing=False) and not a.peer_rebuilding
    (again,) = b.receive(told)
    assert again == LockstepRejoin(1, 4)
    assert a.receive(again) == [] and a.peer_rebuilding
    exchange([a, b], [a.propose()], random.Random(0))
    assert a.take_generation() == b.take_generation() == 4


@settings(max_examples=60, deadline=None)
@given(size=st.integers(2, 4), seed=st.integers(0, 10_000), rounds=st.integers(1, 4))
def test_every_rank_agrees_on_one_rising_generation(size: int, seed: int, rounds: int) -> None:
    rng = random.Random(seed)
    ranks = [GroupRejoin(r, size) for r in range(size)]
    agreed = []
    for _ in range(rounds):
        if rng.random() < 0.3:  # an engine core restarts and forgets
            victim = rng.randrange(size)
            ranks[victim] = GroupRejoin(victim, size)
        order = rng.sample(range(size), size)
        exchange(ranks, [ranks[r].propose() for r in order], rng)
        generations = {node.take_generation() for node in ranks}
        assert len(generations) == 1 and None not in generations, generations
        agreed.append(generations.pop())
    assert agreed == sorted(set(agreed))  # each rebuild is a new generation
