"""``shoal probe KIND ID``: is one actor of a deployment ready? For orchestrators' probes
(a Kubernetes exec readiness probe, a systemd or compose health check).

The probe joins the bus, listens to the heartbeats and status events of actors of ``KIND``
(``bus.runtime.liveness``) until ``ID`` is heard from, and exits 0 if that actor is READY (with
``--alive``: in any state but DEAD or STOPPED, i.e. its process is up and on the bus), 1 if it
is in another state, 2 if it was not heard from within the timeout (every actor sends a
heartbeat each second). The bus credentials come from ``SHOAL_NATS_USER`` and
``SHOAL_NATS_PASSWORD`` in the environment (``bus.nats_ops.credentials``), never from the command
line, and ``--nats-url`` is checked like the actors' (no credentials in it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from shoal.bus import connect_bus
from shoal.bus.base import Bus
from shoal.bus.errors import BusError
from shoal.bus.messages.control import ActorState
from shoal.bus.nats_ops.credentials import CredentialsError, resolve_credentials
from shoal.bus.runtime.liveness import GONE_STATES, LivenessTable, watch_liveness
from shoal.bus.subjects import Subjects
from shoal.deploy.arguments import add_deployment_bus_arguments

EXIT_READY, EXIT_NOT_READY, EXIT_UNHEARD = 0, 1, 2
DEFAULT_TIMEOUT_S = 5.0  # five heartbeat intervals
ACTOR_ID_ENV = "SHOAL_ACTOR_ID"


def add_probe_arguments(
    parser: argparse.ArgumentParser, actor_kinds: tuple[str, ...], namespace: str
) -> None:
    """``namespace``: the default of ``--namespace`` (the deployments' default)."""
    parser.add_argument("kind", choices=actor_kinds, help="the actor's kind")
    parser.add_argument(
        "actor_id",
        metavar="ID",
        nargs="?",
        default=None,
        help=f"the actor's id (engine-0, kv-cpu, ...; default: ${ACTOR_ID_ENV}, as the "
        "Kubernetes manifests set it: exec probes expand no variables)",
    )
    add_deployment_bus_arguments(parser, namespace)
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="how long to wait for the actor's heartbeat",
    )
    parser.add_argument(
        "--alive",
        action="store_true",
        help="succeed in any state but dead or stopped (a liveness probe), not only ready",
    )


def probed_id(ns: argparse.Namespace, env: dict[str, str] | None = None) -> str:
    """The ID argument, else ``$SHOAL_ACTOR_ID``; ``ValueError`` if neither is set."""
    env = dict(os.environ) if env is None else env
    actor_id = ns.actor_id or env.get(ACTOR_ID_ENV)
    if not actor_id:
        raise ValueError(f"shoal probe needs the actor's ID (or ${ACTOR_ID_ENV})")
    return str(actor_id)


async def actor_state(
    bus: Bus, namespace: str, kind: str, actor_id: str, timeout_s: float
) -> ActorState | None:
    """The state ``actor_id`` reports next on ``bus``; None if it says nothing in time."""
    table = LivenessTable()
    heard = asyncio.Event()
    subscriptions = await watch_liveness(
        bus, Subjects(namespace), kind, table, only=(actor_id,), on_change=lambda _: heard.set()
    )
    try:
        await asyncio.wait_for(heard.wait(), timeout_s)
    except TimeoutError:
        return None
    finally:
        for subscription in subscriptions:
            await subscription.unsubscribe()
    peer = table.get(actor_id)
    return None if peer is None else peer.state


def exit_code(state: ActorState | None, *, alive: bool) -> int:
    if state is None:
        return EXIT_UNHEARD
    if state is ActorState.READY or (alive and state not in GONE_STATES):
        return EXIT_READY
    return EXIT_NOT_READY


async def run_probe(ns: argparse.Namespace, actor_id: str) -> int:
    """The probe of ``shoal probe``: prints the state heard and returns the exit code."""
    try:
        credentials = resolve_credentials()
        bus = await connect_bus(ns.nats_url, **(credentials.bus_options() if credentials else {}))
    except (CredentialsError, BusError) as exc:
        print(f"{ns.kind} {actor_id}: no bus: {exc}", file=sys.stderr)
        return EXIT_UNHEARD
    try:
        state = await actor_state(bus, ns.namespace, ns.kind, actor_id, ns.timeout_s)
    finally:
        await bus.close()
    code = exit_code(state, alive=ns.alive)
    heard = "not heard from" if state is None else state.name.lower()
    print(f"{ns.kind} {actor_id}: {heard}", file=sys.stdout if code == 0 else sys.stderr)
    return code
