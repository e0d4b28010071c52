"""Tensor-parallel groups rebuilt per epoch: the board's keys and hosts (pure), the rejoin order
(rank 0 hosts and publishes, the others read), and ``TPGroup`` in two real processes (gloo): a
rank whose peer was killed drops its broken group and joins a new one, on a new port, with the
peer's replacement."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
from typing import Any

import pytest

from shoal.bus.transport.memory import InMemoryBus
from shoal.workers.group_ports import (
    LOOPBACK,
    KvPortBoard,
    advertised_host,
    group_key,
    rejoin_group,
    split_init_method,
)

JOIN_S = 60.0
KEY_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_=.")


def test_group_keys_are_valid_kv_keys_one_per_engine_and_epoch() -> None:
    assert group_key("engine-0", "e1") == "engine-0.e1"
    odd = group_key("engine-0", "3f2a.1 é/x")
    assert set(odd) <= KEY_CHARS and odd.count(".") == 1
    epochs = ["e1", "e2", "e.1", "e_1", "e=2E1", "e 1", "é"]
    assert len({group_key("engine-0", e) for e in epochs}) == len(epochs)
    assert group_key("engine-0", "e1") != group_key("engine-1", "e1")
    with pytest.raises(ValueError):
        group_key("engine-0", "")


def test_init_methods_and_the_advertised_host() -> None:
    assert split_init_method("tcp://10.0.0.7:29500") == ("10.0.0.7", 29500)
    assert split_init_method("tcp://[::1]:1234") == ("::1", 1234)
    for bad in ("10.0.0.7:29500", "tcp://host", "env://"):
        with pytest.raises(ValueError):
            split_init_method(bad)
    assert advertised_host("tcp://node-a:29500") == "node-a"  # the static group's host
    assert advertised_host(None) == LOOPBACK


class FakeMember:
    """Records the group calls; rank 0 'hosts' on a new port each time."""

    def __init__(self, rank: int, log: list[tuple[Any, ...]]) -> None:
        self.rank = rank
        self.log = log
        self.next_port = 40000

    def leave(self) -> None:
        self.log.append(("leave", self.rank))

    def host(self, host: str, timeout_s: float) -> str:
        self.next_port += 1
        return f"tcp://{host}:{self.next_port}"

    def join(self, init_method: str, timeout_s: float) -> None:
        self.log.append(("join", self.rank, init_method))


async def _in_thread(fn: Any, *args: Any) -> Any:
    return await asyncio.to_thread(fn, *args)


async def test_rank_zero_publishes_the_address_the_other_ranks_join() -> None:
    bus = InMemoryBus()
    await bus.connect()
    board = KvPortBoard(bus, "test-ports")
    log: list[tuple[Any, ...]] = []
    members = [FakeMember(0, log), FakeMember(1, log)]

    async def rejoin(epoch: str) -> list[str]:
        key = group_key("engine-0", epoch)
        return list(
            await asyncio.gather(
                *(  # rank 1 first: it must wait for rank 0's address
                    rejoin_group(m, board, key, host="h", timeout_s=5, in_thread=_in_thread)
                    for m in reversed(members)
                )
            )
        )

    first = await rejoin("e1")
    assert first == ["tcp://h:40001", "tcp://h:40001"]
    second = await rejoin("e2")
    assert second == ["tcp://h:40002", "tcp://h:40002"]
    for rank in (0, 1):  # each rank left its group before every join
        mine = [entry[0] for entry in log if entry[1] == rank]
        assert mine == ["leave", "join", "leave", "join"]


async def test_a_rank_gives_up_when_no_address_comes() -> None:
    bus = InMemoryBus()
    await bus.connect()
    with pytest.raises(TimeoutError, match=r"engine-0\.e9"):
        await rejoin_group(
            FakeMember(1, []),
            KvPortBoard(bus, "test-ports"),
            group_key("engine-0", "e9"),
            host="h",
            timeout_s=0.2,
            in_thread=_in_thread,
        )


# ---- two real processes ------------------------------------------------------------------


def _peer_main(rank: int, commands: Any, answers: Any) -> None:
    """A rank in its own process: leaves its group, hosts or joins one, sums a tensor."""
    import torch

    from shoal.workers.parallel import TPGroup

    torch.set_num_threads(1)
    group = TPGroup(rank, 2)
    while True:
        command, arg = commands.get()
        try:
            if command == "leave":
                group.leave()
                answers.put("left")
            elif command == "host":
                answers.put(group.host("127.0.0.1", JOIN_S))
            elif command == "join":
                group.join(arg, JOIN_S)
                answers.put("joined")
            elif command == "sum":
                x = torch.full((3,), float(arg))
                torch.distributed.all_reduce(x)
                answers.put(x.tolist())
        except Exception as exc:  # reported to the test
            answers.put(repr(exc))


class Peer:
    """One rank's process, with its own queues (a killed reader would hold a shared one)."""

    def __init__(self, rank: int) -> None:
        ctx = mp.get_context("spawn")
        self.commands, self.answers = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(target=_peer_main, args=(rank, self.commands, self.answers))
        self.process.start()

    def send(self, command: str, arg: object = None) -> None:
        self.commands.put((command, arg))

    def answer(self) -> Any:
        return self.answers.get(timeout=JOIN_S + 30)

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)  # type: ignore[arg-type]
        self.process.join(timeout=30)


def _round(survivor: Peer, fresh: Peer, host_rank: Peer) -> tuple[str, list[list[float]]]:
    """Both ranks leave their group and join a new one hosted by ``host_rank``; then each
    sums its rank + 1."""
    for peer in (survivor, fresh):
        peer.send("leave")
    assert [survivor.answer(), fresh.answer()] == ["left", "left"]
    host_rank.send("host")
    address = host_rank.answer()
    assert address.startswith("tcp://127.0.0.1:"), address
    for peer in (survivor, fresh):
        peer.send("join", address)
    assert [survivor.answer(), fresh.answer()] == ["joined", "joined"]
    survivor.send("sum", 1)
    fresh.send("sum", 2)
    return address, [survivor.answer(), fresh.answer()]


@pytest.mark.timeout(300)
def test_a_survivor_drops_its_broken_group_and_joins_a_new_one_on_a_new_port() -> None:
    ranks = [Peer(0), Peer(1)]
    try:
        first, sums = _round(ranks[0], ranks[1], host_rank=ranks[0])
        assert sums == [[3.0] * 3] * 2
        # rank 1 dies; its replacement and the survivor (rank 0, holding the broken group)
        ranks[1].kill()
        ranks[1] = Peer(1)
        second, sums = _round(ranks[0], ranks[1], host_rank=ranks[0])
        assert sums == [[3.0] * 3] * 2
        assert second != first
        # now rank 0 dies: the survivor is rank 1, the new host a fresh rank 0
        ranks[0].kill()
        ranks[0] = Peer(0)
        third, sums = _round(ranks[1], ranks[0], host_rank=ranks[0])
        assert sums == [[3.0] * 3] * 2
        assert third not in (first, second)
    finally:
        for peer in ranks:
            if peer.process.is_alive():
                peer.kill()
