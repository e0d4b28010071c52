"""Which actors a deployment runs: one plan, from the deployment's ``ShoalConfig``, used by the
offline ``LLM`` (tasks in one loop), local single-node mode (supervised processes) and
``shoal actor`` (one process on some host).

Per data-parallel rank ``d`` there is one engine core ``engine-d`` and ``tensor_parallel_size``
workers ``worker-d-t`` (rank 0 answers for the group); with fault tolerance on (and its recovery
controller not turned off), one recovery controller ``recovery-0`` sends them ``retry``. With KV
offload on, the host's tier actors come first: the secondary tiers, then the CPU tier in front of
them (``kv-cpu`` by default; every engine core of the host shares it). Every
actor is given the whole config plus its place in the deployment (its id, its rank, its peers);
it reads what it needs. Actor classes are named by import path, so a plan can cross a process
boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shoal.bus.base import Bus
from shoal.bus.runtime.actor import Actor
from shoal.bus.runtime.run_actor import build_actor, load_target
from shoal.config.deployment import ShoalConfig
from shoal.deploy.model_files import with_model_files
from shoal.deploy.model_source import ModelNotFoundError, resolve_model
from shoal.tiers.tier_events import kv_events_interval

WORKER_TARGET = "shoal.workers.actor:WorkerActor"
ENGINE_TARGET = "shoal.engine.actor.core_actor:EngineCoreActor"
GATEWAY_TARGET = "shoal.gateway.actor:GatewayActor"
RECOVERY_TARGET = "shoal.engine.recovery.actor:RecoveryControllerActor"
RECOVERY_ID = "recovery-0"
CPU_TIER_TARGET = "shoal.tiers.cpu.actor:CpuTierActor"
FS_TIER_TARGET = "shoal.tiers.secondary.fs_actor:FsTierActor"
OBJ_TIER_TARGET = "shoal.tiers.secondary.obj_actor:ObjTierActor"
P2P_TIER_TARGET = "shoal.tiers.p2p.actor:P2PTierActor"
SECONDARY_TIER_TARGETS = {"fs": FS_TIER_TARGET, "obj": OBJ_TIER_TARGET, "p2p": P2P_TIER_TARGET}


@dataclass(frozen=True)
class ActorPlan:
    name: str
    target: str
    kwargs: dict[str, Any] = field(default_factory=dict)  # besides the bus
    kind: str = ""


def build_config(**options: Any) -> ShoalConfig:
    """``ShoalConfig.from_options`` for a model that resolves here (``model_source``: a
    built-in name, a GGUF file or a Hugging Face directory; None: the default model). The
    options are checked before the model is looked at (a GGUF view is made once)."""
    ShoalConfig.from_options(**{**options, "model": options.get("model") or ""})
    source = resolve_model(options.get("model"))
    options["model"] = source.directory
    if options.get("served_model_name") is None and source.served_name is not None:
        options["served_model_name"] = source.served_name
    if options.get("tokenizer") is not None:
        options["tokenizer"] = _resolved_directory(options["tokenizer"], "tokenizer")
    config = ShoalConfig.from_options(**options)
    draft = config.speculative_config.speculative_model
    if draft is not None:
        draft_dir = _resolved_directory(draft, "speculative_config.model")
        config = config if draft_dir == draft else config.replace(speculative_model=draft_dir)
    return with_model_files(config)


def _resolved_directory(model: str, what: str) -> str:
    """The directory a secondary model argument (a tokenizer, a draft) resolves to: a GGUF
    file's view, a built-in model's directory, or a directory as it is."""
    try:
        return resolve_model(model).directory
    except ModelNotFoundError as exc:
        raise ValueError(f"{what}: {exc}") from None


def engine_id(dp_rank: int) -> str:
    return f"engine-{dp_rank}"


def worker_id(dp_rank: int, tp_rank: int) -> str:
    return f"worker-{dp_rank}-{tp_rank}"


def plan_actors(
    config: ShoalConfig,
    *,
    tp_init_methods: list[str] | None = None,
    ep_init_method: str | None = None,
) -> list[ActorPlan]:
    """Workers first (they load the model), then the engine cores that wait for them, then
    the recovery controller that watches the engine cores (if the config runs one).

    ``tp_init_methods[d]`` is the torch.distributed rendezvous (``tcp://host:port``) of data
    parallel rank d's tensor-parallel group; needed when ``tensor_parallel_size > 1``.
    ``ep_init_method`` is the rendezvous of the expert-parallel group of every data-parallel
    rank's worker; needed with ``enable_expert_parallel`` and ``data_parallel_size > 1``.
    """
    ep_init = ep_init_method if config.parallel_config.runs_in_lockstep else None
    plans = plan_tiers(config)
    tp = config.parallel_config.tensor_parallel_size
    for d in range(config.parallel_config.data_parallel_size):
        init = tp_init_methods[d] if tp_init_methods and tp > 1 else None
        ids = [worker_id(d, t) for t in range(tp)]
        for t, wid in enumerate(ids):
            kwargs = {
                "worker_id": wid,
                "config": config,
                "tp_rank": t,
                "tp_init_method": init,
                "engine_id": engine_id(d),
                "dp_rank": d,
                "ep_init_method": ep_init,
            }
            plans.append(ActorPlan(wid, WORKER_TARGET, kwargs, "worker"))
        kwargs = {"engine_id": engine_id(d), "config": config, "worker_ids": ids, "dp_rank": d}
        plans.append(ActorPlan(engine_id(d), ENGINE_TARGET, kwargs, "engine"))
    if runs_recovery_controller(config):
        kwargs = {"actor_id": RECOVERY_ID, "config": config}
        plans.append(ActorPlan(RECOVERY_ID, RECOVERY_TARGET, kwargs, "recovery"))
    return plans


def plan_tiers(config: ShoalConfig) -> list[ActorPlan]:
    """The KV offload tiers of a host (none with offload off)."""
    kv = config.kv_transfer_config
    if not kv.enabled:
        return []
    namespace = config.bus_config.namespace
    secondaries = []
    for tier_id, tier in zip(kv.secondary_tier_ids, kv.secondary_tiers, strict=True):
        kwargs: dict[str, Any] = {"actor_id": tier_id, "tier_config": tier, "namespace": namespace}
        if tier.type == "p2p":  # it serves peers from this host's CPU tier
            kwargs["cpu_tier_id"] = kv.cpu_tier_id
        else:  # it holds chunks of its own: its KV events for prefix routing, and buckets
            kwargs["kv_events_snapshot_interval_s"] = kv_events_interval(config)
            kwargs["jetstream_replicas"] = config.bus_config.jetstream_replicas
        if tier.type == "obj":  # its probe within the CPU tier's wait for one secondary (/ 4)
            kwargs["probe_timeout_s"] = kv.kv_lookup_timeout_s / 8
        secondaries.append(ActorPlan(tier_id, SECONDARY_TIER_TARGETS[tier.type], kwargs, "tier"))
    cpu_kwargs = {"tier_id": kv.cpu_tier_id, "config": config}
    return [*secondaries, ActorPlan(kv.cpu_tier_id, CPU_TIER_TARGET, cpu_kwargs, "tier")]


def runs_recovery_controller(config: ShoalConfig) -> bool:
    ft = config.fault_tolerance_config
    return ft.enable_fault_tolerance and ft.enable_recovery_controller


async def start_in_process(bus: Bus, plans: list[ActorPlan]) -> list[Actor]:
    """Start the planned actors as tasks of this event loop, in order (workers first)."""
    actors: list[Actor] = []
    try:
        for plan in plans:
            actor = build_actor(load_target(plan.target), bus, plan.kwargs)
            await actor.start()
            actors.append(actor)
    except BaseException:
        await stop_in_process(actors)
        raise
    return actors


async def stop_in_process(actors: list[Actor]) -> None:
    """Stop actors in reverse start order (engine cores before their workers)."""
    for actor in reversed(actors):
        await actor.stop()
