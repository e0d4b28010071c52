"""``shoal actor KIND``: which class and kwargs one actor process of a deployment gets."""

from __future__ import annotations

import argparse
from typing import Any

from shoal.deploy.args import EngineArgs
from shoal.deploy.deployment import (
    GATEWAY_TARGET,
    client_options,
    engine_id,
    plan_actors,
    worker_id,
)


def actor_target(
    kind: str, args: EngineArgs, actor_id: str | None, ns: argparse.Namespace
) -> tuple[str, dict[str, Any]]:
    """The import path and constructor kwargs of the actor ``kind``/``actor_id``."""
    if kind == "gateway":
        kwargs = {
            "actor_id": actor_id or "gateway-0",
            "engine_factory": "shoal.engine.client.engine_client:make_client",
            "engine_options": client_options(args),
            "host": ns.host,
            "port": ns.port,
            "api_key": ns.api_key,
            "served_model_name": args.model_name,
            "namespace": args.namespace,
        }
        return GATEWAY_TARGET, kwargs
    default_id = worker_id(0, 0) if kind == "worker" else engine_id(0)
    wanted = actor_id or default_id
    inits = [ns.tp_init_method or ""] * args.data_parallel_size
    for plan in plan_actors(args, tp_init_methods=inits):
        if plan.name == wanted and plan.kind == kind:
            return plan.target, dict(plan.kwargs)
    names = [p.name for p in plan_actors(args) if p.kind == kind]
    raise ValueError(f"no {kind} named {wanted!r} in this deployment; expected one of {names}")
