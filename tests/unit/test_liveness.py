"""The one liveness table (``bus.runtime.liveness``) and its two users' readings of it: the engine
core's worker link (a worker lost: gone, restarted since the handshake, or silent) and the
engine client's router (an engine core ready: READY and fresh; lost: gone or long silent)."""

from __future__ import annotations

from shoal.bus.messages.control import ActorState, Heartbeat, StatusEvent
from shoal.bus.messages.engine import EngineStats, SchedulerStats
from shoal.bus.runtime.liveness import LivenessTable
from shoal.bus.subjects import Subjects
from shoal.bus.transport.memory import InMemoryBus
from shoal.engine.actor.worker_link import WorkerLink
from shoal.engine.client.router import EngineRouter

READY, STARTING = ActorState.READY, ActorState.STARTING


def beat(actor_id: str, seq: int, state: ActorState = READY) -> Heartbeat:
    return Heartbeat(actor_id, "worker", seq, state, 0.0)


def status(actor_id: str, state: ActorState) -> StatusEvent:
    return StatusEvent(actor_id, "worker", state, 0.0)


def test_a_heartbeat_sequence_that_starts_again_is_a_restart() -> None:
    table = LivenessTable()
    for seq in (0, 1, 2):
        table.on_event(beat("w", seq), now=float(seq))
    assert table.num_restarts("w") == 0 and table.silent_for("w", now=5.0) == 3.0
    table.on_event(beat("w", 0), now=6.0)
    assert table.num_restarts("w") == 1


def test_a_starting_status_after_being_seen_is_one_restart_not_two() -> None:
    table = LivenessTable()
    table.on_event(status("w", STARTING), now=0.0)  # first start: not a restart
    table.on_event(beat("w", 7), now=1.0)
    table.on_event(status("w", ActorState.DEAD), now=2.0)
    table.on_event(status("w", STARTING), now=3.0)
    table.on_event(status("w", STARTING), now=3.1)  # repeated: still one
    table.on_event(beat("w", 0), now=4.0)  # the new process's heartbeats count from 0
    assert table.num_restarts("w") == 1
    assert table.get("w").state is READY  # type: ignore[union-attr]


def test_freshness_and_touch() -> None:
    table = LivenessTable()
    assert table.silent_for("e", now=1.0) is None and not table.is_fresh("e", 10.0, now=1.0)
    table.touch("e", now=1.0)
    assert table.get("e").state is READY  # type: ignore[union-attr]
    assert table.is_fresh("e", 10.0, now=11.0) and not table.is_fresh("e", 10.0, now=11.5)


def _link() -> WorkerLink:
    return WorkerLink(InMemoryBus(), Subjects("t"), "e0", ["w0"], dead_after_s=5.0)


def test_worker_link_reads_a_gone_or_restarted_worker_as_lost() -> None:
    link = _link()
    link.liveness.on_event(beat("w0", 3), now=100.0)
    link.mark_connected()
    link.liveness.on_event(beat("w0", 4), now=100.5)
    assert link.lost_reason("w0", started=100.0, now=101.0) is None
    link.liveness.on_event(beat("w0", 0), now=101.5)  # restarted after the handshake
    assert link.lost_reason("w0", started=100.0, now=102.0) == "worker w0 restarted"
    link.mark_connected()  # the next handshake handled it
    assert link.lost_reason("w0", started=102.0, now=103.0) is None
    link.liveness.on_event(status("w0", ActorState.DRAINING), now=103.0)
    assert link.lost_reason("w0", started=102.0, now=103.0) == "worker w0 is DRAINING"


def test_a_restarted_workers_first_heartbeat_after_the_handshake_is_not_a_restart() -> None:
    """Recovery: the old process beat up to seq 40 and died; the new one answered the
    handshake before its first heartbeat (seq 1) arrived. That heartbeat is the restart the
    handshake already handled, not a new one; a late DEAD of the old process is forgotten too."""
    link = _link()
    link.liveness.on_event(beat("w0", 40), now=10.0)
    link.liveness.on_event(status("w0", ActorState.DEAD), now=11.0)
    link.mark_connected()
    assert link.lost_reason("w0", started=20.0, now=20.5) is None
    link.liveness.on_event(beat("w0", 1), now=21.0)
    assert link.lost_reason("w0", started=20.0, now=21.5) is None
    link.liveness.on_event(beat("w0", 0), now=22.0)  # and now it really restarted again
    assert link.lost_reason("w0", started=20.0, now=22.5) == "worker w0 restarted"


def test_worker_link_reads_a_silent_worker_as_lost_from_the_step_start() -> None:
    link = _link()
    assert link.lost_reason("w0", started=10.0, now=14.0) is None  # never heard: from start
    assert "no heartbeat for 5.5 s" in (link.lost_reason("w0", started=10.0, now=15.5) or "")
    link.liveness.on_event(beat("w0", 1), now=1.0)  # long ago, before the step
    assert link.lost_reason("w0", started=10.0, now=14.0) is None
    assert link.lost_reason("w0", started=10.0, now=16.0) is not None


def stats(engine_id: str, num_running: int, kv_usage: float = 0.0) -> EngineStats:
    return EngineStats(engine_id, SchedulerStats(num_running=num_running, kv_usage=kv_usage), 0.0)


def test_router_sends_to_the_least_loaded_ready_engine() -> None:
    router = EngineRouter(stale_after_s=10.0)
    router.on_stats(stats("e0", 3, kv_usage=0.5), now=0.0)
    router.on_stats(stats("e1", 1), now=0.0)
    picks = [router.pick(now=1.0).engine_id for _ in range(4)]  # type: ignore[union-attr]
    assert picks == ["e1", "e1", "e1", "e0"]  # 1, 2, then 3 vs 3 (less KV used), then 4 vs 3
    router.on_stats(stats("e1", 0), now=2.0)  # a report replaces what was sent since
    assert router.pick(now=2.0).engine_id == "e1"  # type: ignore[union-attr]


def test_router_skips_an_unhealthy_or_stale_engine_and_reads_dead_or_silent_as_lost() -> None:
    router = EngineRouter(stale_after_s=10.0)
    router.on_stats(stats("e0", 0), now=0.0)
    router.on_stats(stats("e1", 5), now=0.0)
    router.liveness.on_event(StatusEvent("e0", "engine", ActorState.UNHEALTHY, 0.0), now=1.0)
    assert [v.engine_id for v in router.ready_engines(now=2.0)] == ["e1"]
    assert router.lost_engines(now=2.0) == []
    router.liveness.on_event(StatusEvent("e0", "engine", ActorState.DEAD, 0.0), now=3.0)
    assert router.lost_engines(now=3.0) == ["e0"]
    assert router.ready_engines(now=10.5) == []  # e1 silent for more than 10 s
    assert router.lost_engines(now=20.5) == ["e0", "e1"]


def beat_of(actor_id: str, seq: int, incarnation: str, state: ActorState = READY) -> Heartbeat:
    return Heartbeat(actor_id, "engine", seq, state, 0.0, incarnation=incarnation)


def test_a_new_incarnation_is_a_restart_even_when_its_sequence_is_higher() -> None:
    """Heartbeats missed (a bus outage) hide a sequence reset; the incarnation does not."""
    table = LivenessTable()
    table.on_event(beat_of("e", 3, "a"), now=0.0)
    table.on_event(beat_of("e", 2, "a"), now=0.5)  # reordered, same life: not a restart
    assert table.num_restarts("e") == 0
    table.on_event(beat_of("e", 9, "b"), now=1.0)
    assert table.num_restarts("e") == 1 and table.get("e").incarnation == "b"  # type: ignore[union-attr]
    table.on_event(StatusEvent("e", "engine", STARTING, 0.0, incarnation="b"), now=1.1)
    assert table.num_restarts("e") == 1  # the same life saying STARTING again


def test_late_messages_of_a_retired_incarnation_are_ignored() -> None:
    table = LivenessTable()
    table.on_event(beat_of("e", 5, "a"), now=0.0)
    table.on_event(beat_of("e", 1, "b"), now=1.0)
    dead_a = StatusEvent("e", "engine", ActorState.DEAD, 0.0, incarnation="a")
    assert not table.on_event(dead_a, now=2.0)
    assert not table.touch("e", now=2.0, incarnation="a")
    peer = table.get("e")
    assert peer is not None and peer.state is READY and peer.seen_at == 1.0
    assert table.num_restarts("e") == 1


def test_a_handshake_forgets_the_incarnation_so_the_new_processs_first_beat_is_no_restart() -> None:
    link = _link()
    link.liveness.on_event(beat_of("w0", 40, "old"), now=10.0)
    link.mark_connected()  # the new process answered before its first heartbeat came
    link.liveness.on_event(beat_of("w0", 1, "new"), now=21.0)
    assert link.lost_reason("w0", started=20.0, now=21.5) is None
    link.liveness.on_event(beat_of("w0", 2, "newer"), now=22.0)  # restarted again
    assert link.lost_reason("w0", started=20.0, now=22.5) == "worker w0 restarted"


def test_router_epoch_counts_new_incarnations_and_ignores_stale_stats() -> None:
    router = EngineRouter(stale_after_s=10.0)
    first = EngineStats("e0", SchedulerStats(num_running=1), 0.0, incarnation="a")
    router.on_stats(first, now=0.0)
    assert router.epoch("e0") == 0
    router.liveness.on_event(StatusEvent("e0", "engine", ActorState.DEAD, 0.0), now=1.0)
    assert router.is_lost("e0", now=1.0)
    again = EngineStats("e0", SchedulerStats(num_running=0), 0.0, incarnation="b")
    assert router.on_stats(again, now=2.0)
    assert router.epoch("e0") == 1 and router.is_ready("e0", now=2.0)  # back, in a new life
    assert not router.on_stats(first, now=3.0)  # a late report of the old life
    assert router.engines["e0"].stats.incarnation == "b"
