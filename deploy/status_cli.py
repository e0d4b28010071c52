"""``shoal status`` and ``shoal top``: the actors of a NATS deployment, from its bus.

Both join the bus (credentials from ``SHOAL_NATS_USER``/``SHOAL_NATS_PASSWORD``, as ``shoal
probe``), listen to every actor's heartbeats and status events (``deploy.status_board``) and
show one row per actor: kind, id, host, incarnation, state, uptime, load, KV usage, steps/s,
restarts seen and the last fault. ``status`` listens for ``--listen-s`` (two heartbeat
intervals by default), prints the table (or, with ``--json``, one JSON object with an
``actors`` list) and exits 0, 1 when no actor was heard from, 2 without a bus. ``top``
redraws the table in the terminal (rich's live display) every ``--refresh-s`` until
interrupted (or for ``--duration-s``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable, Sequence

from rich.console import Console
from rich.live import Live
from rich.table import Table

from shoal.bus import connect_bus
from shoal.bus.base import Bus, Subscription
from shoal.bus.codec import Codec, DecodeError
from shoal.bus.errors import BusError
from shoal.bus.messages.control import ControlEvent, Heartbeat
from shoal.bus.msg import Msg
from shoal.bus.nats_ops.credentials import CredentialsError, resolve_credentials
from shoal.bus.subjects import Subjects
from shoal.deploy.arguments import add_deployment_bus_arguments
from shoal.deploy.status_board import ActorRow, StatusBoard

EXIT_OK, EXIT_UNHEARD, EXIT_NO_BUS = 0, 1, 2
COLUMNS = ("KIND", "ID", "HOST", "INCARNATION", "STATE", "UPTIME", "LOAD", "KV", "STEPS/S",
           "RESTARTS", "LAST FAULT")  # fmt: skip
_CONTROL: Codec[ControlEvent] = Codec(ControlEvent)


def add_status_arguments(parser: argparse.ArgumentParser, namespace: str, *, top: bool) -> None:
    add_deployment_bus_arguments(parser, namespace)
    if top:
        parser.add_argument("--refresh-s", type=float, default=1.0, help="seconds between redraws")
        parser.add_argument(
            "--duration-s", type=float, default=None, help="stop after this long (default: ^C)"
        )
        return
    parser.add_argument(
        "--listen-s", type=float, default=2.5, help="how long to listen for the actors"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object, for scripts")


async def listen(
    bus: Bus,
    namespace: str,
    board: StatusBoard,
    on_change: Callable[[], Awaitable[None]] | None = None,
) -> list[Subscription]:
    """Feed ``board`` with every actor's heartbeats and status events on ``bus`` (then await
    ``on_change``)."""
    subjects = Subjects(namespace)

    async def on_control(msg: Msg) -> None:
        try:
            event = _CONTROL.decode(msg.data)
        except DecodeError:
            return
        if isinstance(event, Heartbeat):
            board.on_heartbeat(event)
        else:
            board.on_status(event)
        if on_change is not None:
            await on_change()

    return [
        await bus.subscribe(subjects.heartbeat(), on_control),
        await bus.subscribe(subjects.status(), on_control),
    ]


def cells(row: ActorRow, now: float) -> list[str]:
    uptime = row.uptime_s(now)
    kv = row.kv_usage
    return [
        row.kind,
        row.actor_id,
        row.host or "-",
        row.incarnation[:12] or "-",
        row.state.name.lower(),
        "-" if uptime is None else _duration(uptime),
        row.shown_load() or "-",
        "-" if kv is None else f"{kv:.0%}",
        "-" if row.steps_per_s is None else f"{row.steps_per_s:.1f}",
        str(row.num_restarts),
        row.last_fault[:40] or "-",
    ]


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def text_table(rows: Sequence[ActorRow], now: float) -> str:
    """The rows as aligned text columns, a header first."""
    lines = [list(COLUMNS), *(cells(row, now) for row in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def rich_table(rows: Sequence[ActorRow], now: float, namespace: str) -> Table:
    table = Table(title=f"shoal {namespace}: {len(rows)} actors", title_justify="left")
    for column in COLUMNS:
        table.add_column(column, no_wrap=True)
    for row in rows:
        table.add_row(*cells(row, now))
    return table


async def connect_operator_bus(ns: argparse.Namespace) -> Bus | None:
    """The deployment's bus (``--nats-url``, credentials from the environment), or None
    after saying why on stderr."""
    try:
        credentials = resolve_credentials()
        return await connect_bus(ns.nats_url, **(credentials.bus_options() if credentials else {}))
    except (CredentialsError, BusError) as exc:
        print(f"shoal {ns.command}: no bus: {exc}", file=sys.stderr)
        return None


async def run_status(ns: argparse.Namespace) -> int:
    bus = await connect_operator_bus(ns)
    if bus is None:
        return EXIT_NO_BUS
    board = StatusBoard()
    try:
        await listen(bus, ns.namespace, board)
        await asyncio.sleep(ns.listen_s)
    finally:
        await bus.close()
    rows, now = board.sorted_rows(), time.time()
    if ns.json:
        print(json.dumps({"namespace": ns.namespace, "actors": [r.as_json(now) for r in rows]}))
    else:
        print(text_table(rows, now))
    return EXIT_OK if rows else EXIT_UNHEARD


async def run_top(ns: argparse.Namespace) -> int:
    bus = await connect_operator_bus(ns)
    if bus is None:
        return EXIT_NO_BUS
    board = StatusBoard()
    deadline = None if ns.duration_s is None else time.monotonic() + ns.duration_s
    try:
        await listen(bus, ns.namespace, board)
        view = rich_table([], time.time(), ns.namespace)
        with Live(view, console=Console(), auto_refresh=False, screen=False) as live:
            while deadline is None or time.monotonic() < deadline:
                await asyncio.sleep(ns.refresh_s)
                live.update(rich_table(board.sorted_rows(), time.time(), ns.namespace))
                live.refresh()
    finally:
        await bus.close()
    return EXIT_OK
