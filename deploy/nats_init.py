"""``shoal nats-init``: creates a namespace's JetStream buckets and stream before its actors
start: the tensor-parallel group-ports and stored-responses key-value buckets, the KV-offload
and LoRA-adapter object buckets and the prefix-routing KV-events stream, through the calls the
actors open them with (so with their settings), with ``--jetstream-replicas`` copies.
Idempotent: an existing one is kept, only its replicas brought to ``--jetstream-replicas`` (a
deployment moved onto a cluster) and the subjects a newer shoal captures added to the KV-events
stream (the tiers' KV events).

With per-role NATS users (``shoal nats-auth``) no actor may create a bucket or stream (whoever
creates one picks its subjects: ``bus.nats_ops.permissions``), so this runs first, as the
``<namespace>-provisioner`` user. Without users the first actor to need one creates it and this
is optional.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from shoal.bus import connect_bus
from shoal.bus.base import Bus
from shoal.bus.errors import BusError
from shoal.bus.jetstream.replicas import add_stream_subjects, set_stream_replicas, stream_replicas
from shoal.bus.nats_ops.credentials import CredentialsError, resolve_credentials
from shoal.bus.subjects import Subjects
from shoal.deploy.arguments import JoinNatsUrls, option_default, positive_int
from shoal.kv_events.stream import kv_events_subjects, open_kv_events_stream
from shoal.workers.group_ports import open_port_bucket

EXIT_OK, EXIT_FAILED = 0, 1


def add_nats_init_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nats-url",
        dest="nats_url",
        action=JoinNatsUrls,
        required=True,
        help="the deployment's NATS servers (comma-separated or repeated; no credentials)",
    )
    parser.add_argument(
        "--namespace", default=option_default("namespace"), help="the deployment's namespace"
    )
    parser.add_argument(
        "--jetstream-replicas",
        type=positive_int,
        default=option_default("jetstream_replicas"),
        help="copies of each bucket and stream on a NATS cluster (as the actors are given)",
    )
    parser.add_argument(
        "--kv-events-snapshot-interval",
        dest="kv_events_snapshot_interval_s",
        type=float,
        default=option_default("kv_events_snapshot_interval_s"),
        help="as the engine cores are given: the KV-events stream keeps a few intervals",
    )


async def provision(
    bus: Bus, namespace: str, *, replicas: int = 1, snapshot_interval_s: float = 30.0
) -> list[str]:
    """Open (creating what is missing) every bucket and stream of ``namespace``; what each is."""
    subjects = Subjects(namespace)
    ports, objects = subjects.group_ports_bucket(), subjects.object_bucket()
    adapters, responses = subjects.lora_bucket(), subjects.responses_bucket()
    await open_port_bucket(bus, ports, replicas=replicas)
    await bus.open_kv(responses, replicas=replicas)
    await (await bus.open_object_store(objects, replicas=replicas)).close()
    await (await bus.open_object_store(adapters, replicas=replicas)).close()
    events = await open_kv_events_stream(bus, subjects, replicas, snapshot_interval_s)
    added = await add_stream_subjects(bus, events.name, kv_events_subjects(subjects))
    ready = []
    for stream, what in (
        (f"KV_{ports}", f"key-value bucket {ports} (tensor-parallel group ports)"),
        (f"OBJ_{objects}", f"object bucket {objects} (KV offload tier 'obj')"),
        (f"OBJ_{adapters}", f"object bucket {adapters} (LoRA adapters: shoal lora push)"),
        (f"KV_{responses}", f"key-value bucket {responses} (stored responses)"),
        (
            events.name,
            f"stream {events.name} (KV events for prefix routing)"
            + (f", now also capturing {', '.join(added)}" if added else ""),
        ),
    ):
        ready.append(what + await _ensure_replicas(bus, stream, replicas))
    return ready


async def _ensure_replicas(bus: Bus, stream: str, replicas: int) -> str:
    """Brings an existing stream to ``replicas`` copies; what changed, for the report."""
    kept = await stream_replicas(bus, stream)
    if kept == replicas:
        return f", {replicas} replica(s)"
    await set_stream_replicas(bus, stream, replicas)
    return f", {replicas} replica(s) (was {kept})"


async def run_nats_init(ns: argparse.Namespace) -> int:
    """``shoal nats-init``: prints each bucket and stream ready, or why not."""
    try:
        credentials = resolve_credentials(ns.nats_user, ns.nats_password_file)
        options: dict[str, Any] = credentials.bus_options() if credentials else {}
        bus = await connect_bus(ns.nats_url, **options)
    except (CredentialsError, BusError) as exc:
        print(f"shoal nats-init: {exc}", file=sys.stderr)
        return EXIT_FAILED
    try:
        ready = await provision(
            bus,
            ns.namespace,
            replicas=ns.jetstream_replicas,
            snapshot_interval_s=ns.kv_events_snapshot_interval_s,
        )
    except Exception as exc:  # BusError, or the NATS client's own (only bus/ names them)
        print(f"shoal nats-init: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        await bus.close()
    for line in ready:
        print(f"ready: {line}")
    return EXIT_OK
