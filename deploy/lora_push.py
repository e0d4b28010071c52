"""``shoal lora push NAME PATH``: put a LoRA adapter folder (PEFT's format) into a deployment's
object store, so that gateways and workers on any host serve it as ``nats-object://NAME``
(``--lora-modules NAME=nats-object://NAME`` or ``POST /v1/load_lora_adapter``) with no shared
filesystem. The folder is checked first, as the gateway will check it (its rank against
``--max-lora-rank``). With per-role NATS users it runs as the ``<namespace>-provisioner``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from shoal.bus import connect_bus
from shoal.bus.errors import BusError
from shoal.bus.folder_objects import put_folder
from shoal.bus.nats_ops.credentials import CredentialsError, resolve_credentials
from shoal.bus.subjects import Subjects
from shoal.config.lora import LORA_RANKS
from shoal.config.peft_adapter import LoRAAdapterError, check_adapter
from shoal.deploy.arguments import JoinNatsUrls, option_default

EXIT_OK, EXIT_FAILED = 0, 1


def add_lora_push_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="the adapter's name in the store (nats-object://NAME)")
    parser.add_argument("path", type=Path, help="the adapter's folder (PEFT's format)")
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
        "--max-lora-rank",
        type=int,
        choices=LORA_RANKS,
        default=max(LORA_RANKS),
        help="refuse an adapter of a higher rank (the servers' --max-lora-rank)",
    )


async def run_lora_push(ns: argparse.Namespace) -> int:
    try:
        check_adapter(ns.path, max_lora_rank=ns.max_lora_rank)
        credentials = resolve_credentials(ns.nats_user, ns.nats_password_file)
        options: dict[str, Any] = credentials.bus_options() if credentials else {}
        bus = await connect_bus(ns.nats_url, **options)
    except (LoRAAdapterError, CredentialsError, BusError) as exc:
        print(f"shoal lora push: {exc}", file=sys.stderr)
        return EXIT_FAILED
    bucket = Subjects(ns.namespace).lora_bucket()
    try:
        store = await bus.open_object_store(bucket)
        size = await put_folder(store, ns.name, ns.path, writer="shoal lora push")
        await store.close()
    except Exception as exc:  # BusError, or the NATS client's own (only bus/ names them)
        print(f"shoal lora push: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        await bus.close()
    print(f"pushed {ns.path} as nats-object://{ns.name} ({size} bytes, bucket {bucket})")
    return EXIT_OK
