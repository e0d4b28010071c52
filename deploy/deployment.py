"""Which actors an ``EngineArgs`` deployment runs, with their constructor kwargs: one plan used
by the offline ``LLM`` (tasks in one loop), local single-node mode (supervised processes) and
``shoal actor`` (one process on some host).

Per data-parallel rank ``d`` there is one engine core ``engine-d`` and ``tensor_parallel_size``
workers ``worker-d-t`` (rank 0 answers for the group). Actor classes are named by import path:
the engine never imports the workers' code, it only starts them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shoal.bus.actor import Actor
from shoal.bus.base import Bus
from shoal.bus.run_actor import load_target
from shoal.deploy.args import EngineArgs

WORKER_TARGET = "shoal.workers.actor:WorkerActor"
ENGINE_TARGET = "shoal.engine.actor.core_actor:EngineCoreActor"
GATEWAY_TARGET = "shoal.gateway.actor:GatewayActor"


@dataclass(frozen=True)
class ActorPlan:
    name: str
    target: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    kind: str = ""


def engine_id(dp_rank: int) -> str:
    return f"engine-{dp_rank}"


def worker_id(dp_rank: int, tp_rank: int) -> str:
    return f"worker-{dp_rank}-{tp_rank}"


def resolve_dtype(args: EngineArgs) -> str:
    if args.dtype != "auto":
        return args.dtype
    return "bfloat16" if args.device.startswith("cuda") else "float32"


def runner_options(args: EngineArgs, tp_rank: int, tp_init_method: str | None) -> dict[str, Any]:
    options: dict[str, Any] = {
        "dtype": resolve_dtype(args),
        "device": args.device,
        "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "seed": args.seed,
        "tp_rank": tp_rank,
        "tp_size": args.tensor_parallel_size,
    }
    if args.max_model_len is not None:
        options["max_model_len"] = args.max_model_len
    if args.num_gpu_blocks_override is not None:
        options["num_blocks"] = args.num_gpu_blocks_override
    if args.kv_cache_memory is not None:
        options["kv_cache_memory_bytes"] = args.kv_cache_memory
    if tp_init_method is not None:
        options["tp_init_method"] = tp_init_method
    return options


def engine_options(args: EngineArgs) -> dict[str, Any]:
    return {
        "namespace": args.namespace,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "block_size": args.block_size,
        "enable_prefix_caching": args.enable_prefix_caching,
        "policy": args.scheduling_policy,
        "num_blocks_override": args.num_gpu_blocks_override,
        "max_waiting_requests": args.max_waiting_requests,
        "step_timeout_s": args.step_timeout_s,
    }


def plan_actors(args: EngineArgs, *, tp_init_methods: list[str] | None = None) -> list[ActorPlan]:
    """Workers first (they load the model), then the engine cores that wait for them.

    ``tp_init_methods[d]`` is the torch.distributed rendezvous (``tcp://host:port``) of data
    parallel rank d's tensor-parallel group; needed when ``tensor_parallel_size > 1``.
    """
    plans: list[ActorPlan] = []
    tp = args.tensor_parallel_size
    for d in range(args.data_parallel_size):
        init = tp_init_methods[d] if tp_init_methods and tp > 1 else None
        ids = [worker_id(d, t) for t in range(tp)]
        for t, wid in enumerate(ids):
            kwargs = {
                "worker_id": wid,
                "model_dir": args.model,
                "runner_options": runner_options(args, t, init),
                "engine_id": engine_id(d),
                "namespace": args.namespace,
            }
            plans.append(ActorPlan(wid, WORKER_TARGET, kwargs, "worker"))
        kwargs = {"engine_id": engine_id(d), "worker_ids": ids, **engine_options(args)}
        plans.append(ActorPlan(engine_id(d), ENGINE_TARGET, kwargs, "engine"))
    return plans


def client_options(args: EngineArgs) -> dict[str, Any]:
    """Kwargs of ``engine.client.AsyncEngineClient`` (after the bus)."""
    return {
        "model_dir": args.model,
        "served_model_name": args.model_name,
        "max_model_len": args.max_model_len,
        "namespace": args.namespace,
    }


async def start_in_process(bus: Bus, plans: list[ActorPlan]) -> list[Actor]:
    """Start the planned actors as tasks of this event loop, in order (workers first)."""
    actors: list[Actor] = []
    try:
        for plan in plans:
            kwargs = dict(plan.kwargs)
            actor_id = kwargs.pop("worker_id", None) or kwargs.pop("engine_id")
            actor = load_target(plan.target)(bus, actor_id, **kwargs)
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
