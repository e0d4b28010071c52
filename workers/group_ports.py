"""Where a tensor-parallel group of one epoch meets: rank 0 puts its rendezvous address
(``tcp://host:port``) on a board under a key made of the engine id and the epoch, the other ranks
read it there.

The board is the key-value bucket ``subjects.group_ports_bucket()`` (``Bus.open_kv``: JetStream
on NATS, shared by the buses of one broker in memory; entries expire after ``PORTS_TTL_S``, long
after every rank has read them; created with the deployment's ``jetstream_replicas``, so it
outlives a node of a NATS cluster). An epoch must be unique for the engine core (across its
restarts too): a key left by an earlier group of the same epoch would send the readers to a
dead address.

Host rank 0 advertises: that of the static ``tp_init_method`` when the deployment has one (the
static group's rendezvous lives on rank 0, so the other ranks can reach that host), else
loopback (every rank on one host, as in local mode).
"""

from __future__ import annotations

import asyncio
import string
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from shoal.bus.base import Bus
from shoal.bus.buckets import KvBucket
from shoal.bus.errors import BusTimeoutError
from shoal.bus.subjects import Subjects

LOOPBACK = "127.0.0.1"
PORTS_TTL_S = 3600.0
_KEY_CHARS = frozenset(string.ascii_letters + string.digits + "-_")


def group_key(engine_id: str, epoch: str) -> str:
    """The KV key of ``engine_id``'s group of ``epoch``: ``<engine>.<epoch>``, each part with
    any byte outside ``[-_a-zA-Z0-9]`` written as ``=XX`` (one-to-one, so two epochs never
    share a key)."""
    if not engine_id or not epoch:
        raise ValueError(
            f"a group key needs an engine id and an epoch, got {engine_id!r}, {epoch!r}"
        )
    return f"{_escape(engine_id)}.{_escape(epoch)}"


def _escape(part: str) -> str:
    return "".join(
        ch if ch in _KEY_CHARS else "".join(f"={b:02X}" for b in ch.encode()) for ch in part
    )


def split_init_method(init_method: str) -> tuple[str, int]:
    """``tcp://host:port`` → (host, port)."""
    scheme, _, rest = init_method.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme != "tcp" or not host or not port.isdigit():
        raise ValueError(f"expected tcp://host:port, got {init_method!r}")
    return host.strip("[]"), int(port)


def advertised_host(static_init_method: str | None) -> str:
    """The host rank 0 hosts each new group's rendezvous on (see the module docstring)."""
    if static_init_method:
        return split_init_method(static_init_method)[0]
    return LOOPBACK


class PortBoard(Protocol):
    """Where rank 0 leaves a group's address and the other ranks find it."""

    async def put(self, key: str, init_method: str) -> None: ...

    async def read(self, key: str, timeout_s: float) -> str:
        """The address under ``key``, waiting up to ``timeout_s`` for it (``TimeoutError``)."""
        ...


async def open_port_bucket(bus: Bus, name: str, *, replicas: int = 1) -> KvBucket:
    """The board's bucket ``name``, opened, or created with its settings (also by
    ``shoal nats-init``)."""
    return await bus.open_kv(name, ttl_s=PORTS_TTL_S, replicas=replicas)


class KvPortBoard:
    """The board on the bus's key-value bucket ``bucket_name`` (``Bus.open_kv``: JetStream on
    NATS, the broker's own in memory), opened, or created, on first use."""

    def __init__(self, bus: Bus, bucket_name: str, *, replicas: int = 1) -> None:
        self._bus = bus
        self._name = bucket_name
        self._replicas = replicas
        self._bucket: KvBucket | None = None

    async def _open(self) -> KvBucket:
        if self._bucket is None:
            self._bucket = await open_port_bucket(self._bus, self._name, replicas=self._replicas)
        return self._bucket

    async def put(self, key: str, init_method: str) -> None:
        await (await self._open()).put(key, init_method.encode())

    async def read(self, key: str, timeout_s: float) -> str:
        bucket = await self._open()
        try:
            async with asyncio.timeout(timeout_s):
                async for entry in bucket.watch(key, timeout=timeout_s):
                    if entry.value:
                        return entry.value.decode()
        except (TimeoutError, BusTimeoutError):
            pass
        raise TimeoutError(f"no group address under {key!r} within {timeout_s} s")


def port_board_for(bus: Bus, subjects: Subjects, *, replicas: int = 1) -> PortBoard:
    """The board of the deployment ``bus`` belongs to (``replicas``: its bucket's copies in a
    NATS cluster)."""
    return KvPortBoard(bus, subjects.group_ports_bucket(), replicas=replicas)


class GroupMember(Protocol):
    """A rank that can leave its group and join another (``workers.parallel.TPGroup``)."""

    @property
    def rank(self) -> int: ...

    def leave(self) -> None: ...

    def host(self, host: str, timeout_s: float) -> str: ...

    def join(self, init_method: str, timeout_s: float) -> None: ...


InThread = Callable[..., Awaitable[Any]]


async def rejoin_group(
    member: GroupMember,
    board: PortBoard,
    key: str,
    *,
    host: str,
    timeout_s: float,
    in_thread: InThread,
) -> str:
    """Drop ``member``'s group, meet the other ranks at ``key`` and join the new group there;
    returns its address. ``in_thread`` runs the blocking group calls (the runner thread), so the
    event loop keeps serving while the ranks wait for each other."""
    await in_thread(member.leave)
    if member.rank == 0:
        init_method = str(await in_thread(member.host, host, timeout_s))
        await board.put(key, init_method)
    else:
        init_method = await board.read(key, timeout_s)
    await in_thread(member.join, init_method, timeout_s)
    return init_method
