"""The peer-to-peer tier's pure books: served sessions and their time to live, planned pulls
matched by the promotion's keys, the peers a round waits for, and the best answer."""

from __future__ import annotations

import pytest

from shoal.bus.messages.offload import KVLayout, RegionRef
from shoal.bus.messages.p2p import PeerHeld
from shoal.tiers.books.p2p_sessions import PeerDirectory, PlannedPulls, ServedSessions, best_answer

REGION = RegionRef("/dev/shm/x.kv", "g1", 4, KVLayout("m", 1, 2, 1, 4, "float32", 1, 1))
K = [bytes([i]) * 20 for i in range(6)]


def test_a_served_session_gives_each_chunk_until_it_ends_or_expires() -> None:
    served = ServedSessions(ttl_s=10.0)
    served.add("s", "peer", REGION, K[:2], [3, 1], now=0.0)
    assert served.chunk_of("s", 1, now=5.0) == (REGION, 1, K[1])
    assert served.chunk_of("s", 2, now=5.0) is None  # past the pinned run
    assert served.chunk_of("s", -1, now=5.0) is None
    assert served.chunk_of("s", 0, now=10.0) is None  # expired: no byte of it is served
    assert [s.session for s in served.expire(now=10.0)] == ["s"]
    assert served.end("s") is None and len(served) == 0


def test_ending_a_session_hands_its_pins_back_once() -> None:
    served = ServedSessions(ttl_s=10.0)
    served.add("s", "peer", REGION, K[:1], [0], now=0.0)
    ended = served.end("s")
    assert ended is not None and (ended.keys, ended.slot_ids) == (K[:1], [0])
    assert served.end("s") is None
    assert served.expire(now=99.0) == []
    with pytest.raises(ValueError, match="one slot per key"):
        served.add("t", "peer", REGION, K[:2], [0], now=0.0)


def test_a_planned_pull_is_taken_by_a_promotion_of_its_prefix() -> None:
    plans = PlannedPulls(ttl_s=5.0)
    assert plans.add("peer-a", "s1", K[:4], now=0.0) is None
    assert plans.take(K[1:3], now=1.0) is None  # not from its head
    assert plans.take([K[0], K[2]], now=1.0) is None  # not its keys
    plan = plans.take(K[:3], now=1.0)
    assert plan is not None and (plan.peer, plan.session) == ("peer-a", "s1")
    assert plans.take(K[:3], now=1.0) is None  # taken once


def test_a_newer_plan_for_the_same_head_replaces_and_returns_the_old_one() -> None:
    plans = PlannedPulls(ttl_s=5.0)
    plans.add("peer-a", "s1", K[:2], now=0.0)
    replaced = plans.add("peer-b", "s2", K[:3], now=0.5)
    assert replaced is not None and replaced.session == "s1"  # its session must be ended
    assert plans.take(K[:5], now=1.0) is None  # longer than what was pinned
    assert plans.expire(now=5.4) == []
    assert [p.session for p in plans.expire(now=5.5)] == ["s2"]
    assert plans.take(K[:1], now=5.5) is None


def test_the_directory_expects_every_peer_heard_until_it_misses_a_round() -> None:
    peers = PeerDirectory()
    assert peers.expected() == frozenset()
    peers.heard("a")
    peers.heard("b")
    peers.heard("a")
    assert peers.expected() == {"a", "b"}
    peers.missed(["b", "c"])
    assert peers.expected() == {"a"}  # b is not waited for until it is heard again
    peers.heard("b")
    assert peers.expected() == {"a", "b"}


def test_the_longest_answer_wins_the_first_among_equals() -> None:
    assert best_answer([]) is None
    assert best_answer([PeerHeld("a", "s", 0), PeerHeld("b", "s", 0)]) is None
    answers = [PeerHeld("a", "s", 2), PeerHeld("b", "s", 3), PeerHeld("c", "s", 3)]
    assert best_answer(answers) is answers[1]


def test_a_session_served_twice_returns_the_one_it_replaces() -> None:
    served = ServedSessions(ttl_s=10.0)
    assert served.add("s", "peer", REGION, K[:1], [0], now=0.0) is None
    replaced = served.add("s", "peer", REGION, K[1:3], [1, 2], now=1.0)
    assert replaced is not None and replaced.keys == K[:1]  # its pins must go back
    assert [s.keys for s in served.open()] == [K[1:3]]


def test_every_plan_is_taken_when_the_actor_stops() -> None:
    plans = PlannedPulls(ttl_s=5.0)
    plans.add("a", "s1", K[:1], now=0.0, data_address="127.0.0.1:9")
    plans.add("b", "s2", K[2:4], now=0.0)
    taken = plans.take_all()
    assert [(p.session, p.data_address) for p in taken] == [("s1", "127.0.0.1:9"), ("s2", "")]
    assert len(plans) == 0
