"""``shoal actor KIND``: which class and kwargs one actor process of a deployment gets."""

from __future__ import annotations

import argparse
from typing import Any

from shoal.config.deployment import ShoalConfig
from shoal.deploy.deployment import (
    GATEWAY_TARGET,
    RECOVERY_ID,
    engine_id,
    plan_actors,
    worker_id,
)

DEFAULT_IDS = {"worker": worker_id(0, 0), "engine": engine_id(0), "recovery": RECOVERY_ID}


def actor_target(
    kind: str, config: ShoalConfig, actor_id: str | None, ns: argparse.Namespace
) -> tuple[str, dict[str, Any]]:
    """The import path and constructor kwargs of the actor ``kind``/``actor_id``."""
    if kind == "gateway":
        from shoal.deploy.local import HttpOptions

        kwargs = {
            "actor_id": actor_id or "gateway-0",
            "config": config,
            **HttpOptions.from_namespace(ns).gateway_kwargs(),
        }
        return GATEWAY_TARGET, kwargs
    default = config.kv_transfer_config.cpu_tier_id if kind == "tier" else DEFAULT_IDS[kind]
    wanted = actor_id or default
    inits = [ns.tp_init_method or ""] * config.parallel_config.data_parallel_size
    for plan in plan_actors(config, tp_init_methods=inits, ep_init_method=ns.ep_init_method):
        if plan.name == wanted and plan.kind == kind:
            return plan.target, dict(plan.kwargs)
    names = [p.name for p in plan_actors(config) if p.kind == kind]
    raise ValueError(f"no {kind} named {wanted!r} in this deployment; expected one of {names}")
