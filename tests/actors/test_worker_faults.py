"""Fault tolerance in the worker actor, on the in-memory bus and on NATS (same tests), with the
fake runner of ``test_worker_actor``: ``InjectFault`` fails exactly the armed step with a fatal
``StepError``; ``JoinGroup`` makes every rank leave its group and join the epoch's new one at
the address rank 0 published (on NATS: in the JetStream KV bucket); the engine core's link
joins every rank at its handshake and names a rank that cannot join."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest

from shoal.bus.base import Bus
from shoal.bus.messages.fault import FaultInjected, InjectFault
from shoal.bus.messages.worker import GroupJoined, JoinGroup, StepResult
from shoal.bus.runtime.actor import call
from shoal.bus.subjects import Subjects
from shoal.engine.actor.worker_link import WorkerFailure, WorkerLink
from shoal.workers.actor import WorkerActor
from shoal.workers.group_ports import group_key
from tests.actors.test_worker_actor import REPLY, WAIT_S, FakeRunner, Harness, _step, harness
from tests.fixtures.nats import BusFactory

__all__ = ["harness"]  # the fixture, on the in-memory bus and on NATS


async def test_an_injected_fault_fails_exactly_the_armed_step(harness: Harness) -> None:
    armed = await harness.ask(InjectFault(after_steps=1, message="disk on fire"))
    assert armed == FaultInjected("w0", at_step=1)
    before = await harness.ask(_step(1, "a"))
    assert isinstance(before, StepResult) and before.error is None
    failed = await harness.ask(_step(2, "b", cached=("a",)))
    assert isinstance(failed, StepResult) and failed.error is not None
    assert failed.error.fatal
    assert failed.error.req_ids == ["b", "a"]  # the whole batch
    assert "InjectedFault: disk on fire" in failed.error.message
    assert "step 2" in failed.error.message
    after = await harness.ask(_step(3, cached=("a", "b")))  # fires once
    assert isinstance(after, StepResult) and after.error is None
    assert harness.runner.step_order == [1, 2, 3]  # the armed step ran (TP peers not left waiting)
    assert harness.actor.load()["num_step_errors"] == 1


async def test_a_fault_armed_for_the_next_step(harness: Harness) -> None:
    await harness.ask(_step(1, "a"))
    armed = await harness.ask(InjectFault())
    assert isinstance(armed, FaultInjected) and armed.at_step == 1
    failed = await harness.ask(_step(2, cached=("a",)))
    assert isinstance(failed, StepResult) and failed.error is not None and failed.error.fatal


# ---- tensor-parallel groups ----------------------------------------------------------------


class FakeGroup:
    """A rank's group: records leave/join; rank 0 hosts on a new port each time."""

    next_port = 41000  # shared by the ranks of one test, as ports of one host

    def __init__(self, rank: int, fail_join: bool = False) -> None:
        self.rank = rank
        self.size = 2
        self.calls: list[str] = []
        self.thread_ids: set[int] = set()
        self.fail_join = fail_join

    def leave(self) -> None:
        self.calls.append("leave")

    def host(self, host: str, timeout_s: float) -> str:
        FakeGroup.next_port += 1
        return f"tcp://{host}:{FakeGroup.next_port}"

    def join(self, init_method: str, timeout_s: float) -> None:
        self.thread_ids.add(threading.get_ident())
        if self.fail_join:
            raise RuntimeError("connection refused (fake)")
        self.calls.append(f"join {init_method}")


class GroupRunner(FakeRunner):
    def __init__(self, group: FakeGroup) -> None:
        super().__init__()
        self.group = group


class Ranks:
    """Two worker actors (TP ranks of engine e0) and an engine-side bus."""

    def __init__(self, buses: list[Bus], engine_bus: Bus, fail_join: int | None = None) -> None:
        self.namespace = f"tpg{id(self)}"  # a fresh group-ports bucket per test on NATS
        self.groups = [FakeGroup(r, fail_join=r == fail_join) for r in (0, 1)]
        self.actors = [
            WorkerActor(
                bus,
                f"w{r}",
                runner=GroupRunner(self.groups[r]),
                engine_id="e0",
                namespace=self.namespace,
                tp_init_method="tcp://127.0.0.7:29500",
                heartbeat_interval_s=0.05,
            )
            for r, bus in enumerate(buses)
        ]
        self.engine_bus = engine_bus
        self.subjects = Subjects(self.namespace)

    async def join(self, epoch: str) -> list[Any]:
        return list(
            await asyncio.gather(
                *(  # rank 1 asked first: it waits for rank 0's address
                    call(
                        self.engine_bus,
                        self.subjects.worker_in(f"w{r}"),
                        JoinGroup(epoch, timeout_s=5),
                        REPLY,
                        timeout=WAIT_S,
                    )
                    for r in (1, 0)
                )
            )
        )


@pytest.fixture
async def ranks(bus_factory: BusFactory) -> AsyncIterator[Ranks]:
    r = Ranks([await bus_factory(), await bus_factory()], await bus_factory())
    for actor in r.actors:
        await actor.start()
    yield r
    for actor in r.actors:
        await actor.stop()


async def test_every_rank_leaves_its_group_and_joins_the_epochs_new_one(ranks: Ranks) -> None:
    first = await ranks.join("e1")
    assert all(isinstance(j, GroupJoined) and j.epoch == "e1" for j in first)
    address = first[0].init_method
    assert address.startswith("tcp://127.0.0.7:")  # the static rendezvous' host
    assert [j.init_method for j in first] == [address, address]
    second = await ranks.join("e2")
    assert [j.init_method for j in second] == [second[1].init_method] * 2
    assert second[1].init_method != address
    for group in ranks.groups:
        assert group.calls == [
            "leave",
            f"join {address}",
            "leave",
            f"join {second[1].init_method}",
        ]
        assert threading.get_ident() not in group.thread_ids  # joined in the runner thread
    assert [a.group_epoch for a in ranks.actors] == ["e2", "e2"]
    bucket = await ranks.engine_bus.open_kv(ranks.subjects.group_ports_bucket())
    assert await bucket.get(group_key("e0", "e1")) == address.encode()


async def test_the_link_joins_every_rank_at_its_handshake(ranks: Ranks) -> None:
    link = WorkerLink(ranks.engine_bus, ranks.subjects, "e0", ["w0", "w1"])
    await link.start()
    try:
        infos = await link.handshake(WAIT_S, group_epoch="e1")
        assert [i.worker_id for i in infos] == ["w0", "w1"]
        assert [a.group_epoch for a in ranks.actors] == ["e1", "e1"]
        await link.handshake(WAIT_S)  # no epoch: the group is left alone
        assert [g.calls.count("leave") for g in ranks.groups] == [1, 1]
        await link.handshake(WAIT_S, group_epoch="e2")
        assert [a.group_epoch for a in ranks.actors] == ["e2", "e2"]
        assert ranks.groups[0].calls[-1] == ranks.groups[1].calls[-1]
    finally:
        await link.stop()


@pytest.fixture
async def failing_ranks(bus_factory: BusFactory) -> AsyncIterator[Ranks]:
    r = Ranks([await bus_factory(), await bus_factory()], await bus_factory(), fail_join=1)
    for actor in r.actors:
        await actor.start()
    yield r
    for actor in r.actors:
        await actor.stop()


async def test_the_link_names_a_rank_that_cannot_join(failing_ranks: Ranks) -> None:
    link = WorkerLink(failing_ranks.engine_bus, failing_ranks.subjects, "e0", ["w0", "w1"])
    await link.start()
    try:
        with pytest.raises(WorkerFailure, match="worker w1 did not join the group of epoch e1"):
            await link.handshake(WAIT_S, group_epoch="e1")
    finally:
        await link.stop()
