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
    a, b = GroupRejoin(0, 2, "n0"), GroupRejoin(1, 2, "n1")
    exchange([a, b], [a.propose(), b.propose()], random.Random(0))
    assert a.take_epoch() == b.take_epoch() == "1-n0"
    assert a.joined == b.joined == 1 and not a.peer_rebuilding


def test_a_rank_that_subscribed_late_still_hears_the_proposal() -> None:
    a, b = GroupRejoin(0, 2, "n0"), GroupRejoin(1, 2, "n1")
    a.propose()  # went out before b listened: b never got it
    (answer,) = a.receive(b.propose())  # a hears b for the first time: it says its own again
    assert answer == LockstepRejoin(0, 1, nonce="n0")
    (echo,) = b.receive(answer)  # b hears a first time too: says its own once more
    assert a.receive(echo) == []  # and that is the end of it
    assert a.take_epoch() == b.take_epoch() == "1-n0"


def test_echoes_after_the_build_do_not_break_it() -> None:
    a, b = GroupRejoin(0, 2, "n0"), GroupRejoin(1, 2, "n1")
    pa, pb = a.propose(), b.propose()
    (echo,) = a.receive(pb)  # a hears b first time: says its own again
    assert a.take_epoch() == "1-n0"
    b.receive(pa)
    assert b.take_epoch() == "1-n0"
    (told,) = b.receive(echo)  # a late copy of generation 1: b tells its generation ...
    assert told == LockstepRejoin(1, 1, proposing=False) and not b.peer_rebuilding
    assert a.receive(told) == [] and not a.peer_rebuilding  # ... which changes nothing


def test_a_rank_not_rebuilding_learns_the_group_goes_away_and_joins_the_next() -> None:
    a, b = GroupRejoin(0, 2, "n0"), GroupRejoin(1, 2, "n1")
    exchange([a, b], [a.propose(), b.propose()], random.Random(0))
    a.take_epoch(), b.take_epoch()
    exchange([a, b], [b.propose()], random.Random(0))  # b's worker died: b's retry proposes 2
    assert a.peer_rebuilding and b.take_epoch() is None
    exchange([a, b], [a.propose()], random.Random(0))  # a faults, its retry proposes 2 too
    assert a.take_epoch() == b.take_epoch() == "2-n0"
    assert not a.peer_rebuilding and not b.peer_rebuilding


def test_a_restarted_rank_is_told_the_generation_and_proposes_past_it() -> None:
    a, b = GroupRejoin(0, 2, "n0"), GroupRejoin(1, 2, "n1")
    for _ in range(3):
        exchange([a, b], [a.propose(), b.propose()], random.Random(0))
        a.take_epoch(), b.take_epoch()
    b = GroupRejoin(1, 2, "n1")  # b's engine core restarts: it knows no generation
    (told,) = a.receive(b.propose())  # b proposes 1: a is in 3
    assert told == LockstepRejoin(0, 3, proposing=False) and not a.peer_rebuilding
    (again,) = b.receive(told)
    assert again == LockstepRejoin(1, 4, nonce="n1")
    assert a.receive(again) == [] and a.peer_rebuilding
    exchange([a, b], [a.propose()], random.Random(0))
    assert a.take_epoch() == b.take_epoch() == "4-n0"


@settings(max_examples=60, deadline=None)
@given(size=st.integers(2, 4), seed=st.integers(0, 10_000), rounds=st.integers(1, 4))
def test_every_rank_agrees_on_one_rising_generation(size: int, seed: int, rounds: int) -> None:
    rng = random.Random(seed)
    ranks = [GroupRejoin(r, size, f"n{r}") for r in range(size)]
    agreed = []
    for _ in range(rounds):
        if rng.random() < 0.3:  # an engine core restarts and forgets
            victim = rng.randrange(size)
            ranks[victim] = GroupRejoin(victim, size, f"n{victim}.{len(agreed)}")
        order = rng.sample(range(size), size)
        exchange(ranks, [ranks[r].propose() for r in order], rng)
        epochs = {node.take_epoch() for node in ranks}
        assert len(epochs) == 1 and None not in epochs, epochs
        agreed.append(epochs.pop())
    generations = [int(str(epoch).split("-")[0]) for epoch in agreed]
    assert generations == sorted(set(generations))  # each rebuild is a new generation


def test_a_late_repeat_of_an_agreed_generation_does_not_push_a_rank_past_it() -> None:
    """a agreed generation 1 with b; b, before taking it, hears a's repeat and repeats its own;
    a, no longer rebuilding, tells b its generation (1): b must not propose 2."""
    a, b = GroupRejoin(0, 2, "n0"), GroupRejoin(1, 2, "n1")
    a.propose()  # b was not listening yet
    (repeat,) = a.receive(b.propose())
    assert a.take_epoch() == "1-n0"
    (echo,) = b.receive(repeat)  # b has not taken the epoch yet
    (told,) = a.receive(echo)
    assert told == LockstepRejoin(0, 1, proposing=False)
    assert b.receive(told) == [] and b.take_epoch() == "1-n0"
    assert not a.peer_rebuilding and not b.peer_rebuilding


def test_a_withdrawn_proposal_is_not_agreed_with_by_a_late_rank() -> None:
    a, b = GroupRejoin(0, 2, "n0"), GroupRejoin(1, 2, "n1")
    b.receive(a.propose())
    withdrawn = a.abandon()  # a's retry timed out before b proposed
    assert withdrawn == LockstepRejoin(0, 1, nonce="n0", withdrawn=True)
    b.receive(withdrawn)
    b.propose()
    assert b.take_epoch() is None  # not alone
    exchange([a, b], [a.propose()], random.Random(0))
    assert a.take_epoch() == b.take_epoch() == "1-n0"


def test_the_epoch_differs_when_every_engine_core_restarted() -> None:
    first = [GroupRejoin(0, 2, "old0"), GroupRejoin(1, 2, "old1")]
    exchange(first, [node.propose() for node in first], random.Random(0))
    again = [GroupRejoin(0, 2, "new0"), GroupRejoin(1, 2, "new1")]
    exchange(again, [node.propose() for node in again], random.Random(0))
    assert {node.take_epoch() for node in first} == {"1-old0"}
    assert {node.take_epoch() for node in again} == {"1-new0"}


@settings(max_examples=100, deadline=None)
@given(size=st.integers(2, 4), seed=st.integers(0, 10_000))
def test_a_first_build_agrees_on_generation_one_however_takes_and_deliveries_interleave(
    size: int, seed: int
) -> None:
    """Each rank proposes at a random moment (a late subscriber misses earlier proposals) and
    tries to take the epoch between any two deliveries, as an engine core's waiter does."""
    rng = random.Random(seed)
    ranks = [GroupRejoin(r, size, f"n{r}") for r in range(size)]
    listening: set[int] = set()
    channels: list[deque[LockstepRejoin]] = [deque() for _ in ranks]
    taken: dict[int, str] = {}
    for _ in range(5000):
        waiting = [r for r in range(size) if r not in listening]
        busy = [i for i, c in enumerate(channels) if c]
        if waiting and (not busy or rng.random() < 0.2):
            r = rng.choice(waiting)
            listening.add(r)
            channels[r].append(ranks[r].propose())
        elif busy:
            message = channels[rng.choice(busy)].popleft()
            for node in ranks:
                if node.rank != message.rank and node.rank in listening:
                    for answer in node.receive(message):
                        channels[answer.rank].append(answer)
        for r in listening - set(taken):
            if rng.random() < 0.5 and (epoch := ranks[r].take_epoch()) is not None:
                taken[r] = epoch
        if len(taken) == size and not any(channels):
            break
    assert taken == {r: "1-n0" for r in range(size)}, taken
    assert not any(node.peer_rebuilding for node in ranks)
