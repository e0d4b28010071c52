"""Runs one actor as its own OS process: ``python -m shoal.bus.runtime.run_actor --target
module:Class --bus URL [--kwargs JSON] [--bus-options JSON]``. The actor is built as ``Class(bus,
**kwargs)`` (``build_actor``: a keyword whose parameter is typed as a msgspec struct, such as the
deployment's config, is decoded into it) and served until SIGTERM/SIGINT (graceful drain),
until the parent process dies, or until the actor stops itself; the process exits with the
actor's ``exit_code``. NATS credentials come from the environment (``bus.nats_ops.credentials``),
never from the command line."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import os
import sys
import types
import typing
from typing import Any

import msgspec

from shoal.bus import connect_bus
from shoal.bus.base import Bus
from shoal.bus.nats_ops.credentials import resolve_credentials
from shoal.bus.nats_ops.server import die_with_parent
from shoal.bus.runtime.actor import Actor

PARENT_POLL_S = 0.5


def load_target(target: str) -> type[Actor]:
    """``"package.module:ClassName"`` → the class (an ``Actor`` subclass)."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ValueError(f"target must look like 'module:Class', got {target!r}")
    cls = getattr(importlib.import_module(module_name), attr)
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise TypeError(f"{target} is not an Actor subclass")
    return cls


def build_actor(cls: type[Actor], bus: Bus, kwargs: dict[str, Any]) -> Actor:
    """``cls(bus, **kwargs)``, with JSON objects given for struct-typed parameters decoded."""
    hints = typing.get_type_hints(cls.__init__)
    typed = {
        name: msgspec.convert(value, hints[name])
        if isinstance(value, dict) and _names_a_struct(hints.get(name))
        else value
        for name, value in kwargs.items()
    }
    return cls(bus, **typed)


def _names_a_struct(hint: Any) -> bool:
    """``SomeStruct`` or ``SomeStruct | None``."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    return any(isinstance(o, type) and issubclass(o, msgspec.Struct) for o in options)


async def _watch_parent(actor: Actor, parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        await asyncio.sleep(PARENT_POLL_S)
    logging.getLogger(__name__).warning("%r: parent died, stopping", actor)
    actor.request_stop()


async def serve(
    target: str, bus_url: str, kwargs: dict[str, Any], bus_options: dict[str, Any]
) -> int:
    """Run the actor until it stops; its exit code (non-zero asks the supervisor to restart)."""
    cls = load_target(target)
    if not bus_url.startswith("memory") and not {"user", "token", "creds_file"} & set(bus_options):
        credentials = resolve_credentials()  # $SHOAL_NATS_USER / $SHOAL_NATS_PASSWORD
        if credentials is not None:
            bus_options = {**bus_options, **credentials.bus_options()}
    bus = await connect_bus(bus_url, **bus_options)
    actor = build_actor(cls, bus, kwargs)
    actor.owns_bus = True
    watcher = asyncio.create_task(_watch_parent(actor, os.getppid()))
    try:
        await actor.run_forever()
    finally:
        watcher.cancel()
        if bus.is_connected:
            await bus.close()
    return actor.exit_code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m shoal.bus.runtime.run_actor", description=__doc__
    )
    parser.add_argument("--target", required=True, help="module:Class of the actor")
    parser.add_argument("--bus", required=True, help="bus url (nats://host:port)")
    parser.add_argument("--kwargs", default="{}", help="JSON object of constructor kwargs")
    parser.add_argument("--bus-options", default="{}", help="JSON object of bus options")
    parser.add_argument("--log-level", default=os.environ.get("SHOAL_LOG_LEVEL", "WARNING"))
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"
    )
    die_with_parent()
    kwargs, bus_options = json.loads(args.kwargs), json.loads(args.bus_options)
    return asyncio.run(serve(args.target, args.bus, kwargs, bus_options))


if __name__ == "__main__":
    sys.exit(main())
