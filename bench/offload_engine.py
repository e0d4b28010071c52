"""The engines of ``bench/offload.py``: a random Llama, one engine (workers, engine core, tier
actors, a client) in this process on an in-memory bus or a NATS server, one greedy turn timed to
its first token, and the offload options of each mode."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.throughput import VOCAB

BLOCK_SIZE = 16  # tokens per KV block and per offloaded chunk
FIRST_TOKEN = 3  # ids below are pad, bos, eos
LOOKUP_TIMEOUT_S = 30.0  # a long prefix promoted from files (half of it) must not time out
SETTLE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Model:
    path: Path
    num_params: int
    kv_bytes_per_token: int  # every layer's K and V

    @property
    def chunk_bytes(self) -> int:
        return BLOCK_SIZE * self.kv_bytes_per_token


def build_model(out_dir: Path, max_len: int, tiny: bool) -> Model:
    """``bench/throughput.py``'s random Llama with this context, and a tokenizer."""
    from bench.throughput import build_model as build_llama
    from bench.throughput_e2e import save_tokenizer

    num_params = build_llama(out_dir, "float32", tiny, max_len=max_len)
    save_tokenizer(out_dir, VOCAB)
    hidden, layers, heads, kv_heads = (64, 2, 8, 4) if tiny else (512, 6, 8, 4)
    kv_bytes = 2 * layers * kv_heads * (hidden // heads) * 4
    return Model(out_dir, num_params, kv_bytes)


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(n)]


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


@dataclass
class Engine:
    client: Any  # AsyncEngineClient
    core_actor: Any  # EngineCoreActor
    actors: list[Any]  # every actor, in start order
    tiers: dict[str, Any] = field(default_factory=dict)  # tier actors by class name

    @property
    def cpu_tier(self) -> Any:
        return self.tiers.get("CpuTierActor")

    async def stop_engine_core(self) -> None:
        """The engine core and its workers go (the host's tiers stay)."""
        for actor in reversed(self.actors):
            if getattr(actor, "kind", "") in ("engine", "worker"):
                await actor.stop()


@dataclass(frozen=True)
class Turn:
    ttft_s: float
    token_ids: list[int]
    num_cached_tokens: int  # local prefix-cache hit + tokens loaded from the tiers


async def open_engine(
    stack: AsyncExitStack,
    model: Model,
    args: Any,
    bus_url: str | None = None,  # None: a fresh in-memory bus
    namespace: str | None = None,  # two engines of one namespace are two hosts
    **options: Any,
) -> Engine:
    """Workers, engine core and tiers on a bus of their own, a ready client."""
    from shoal.bus import make_bus
    from shoal.deploy.deployment import build_config, plan_actors, start_in_process, stop_in_process
    from shoal.engine.client.engine_client import AsyncEngineClient

    tag = uuid.uuid4().hex[:8]
    namespace = namespace or f"bench-offload-{tag}"
    config = build_config(
        model=str(model.path),
        bus="nats" if bus_url else "memory",
        nats_url=bus_url,
        namespace=namespace,
        dtype="float32",
        device=args.device,
        block_size=BLOCK_SIZE,
        max_model_len=args.max_model_len,
        **options,
    )
    bus = make_bus(bus_url or f"memory://{namespace}")
    await bus.connect()
    stack.push_async_callback(bus.close)
    actors = await start_in_process(bus, plan_actors(config))
    stack.push_async_callback(stop_in_process, actors)
    client = AsyncEngineClient(bus, config)
    await client.start()
    stack.push_async_callback(client.close)
    await client.wait_until_ready(300, num_engines=1)
    by_kind = {type(actor).__name__: actor for actor in actors}
    tiers = {name: actor for name, actor in by_kind.items() if getattr(actor, "kind", "") == "tier"}
    engine = Engine(client, by_kind["EngineCoreActor"], actors, tiers)
    if engine.cpu_tier is not None:
        await until(lambda: connector(engine) is not None and connector(engine).is_active, "attach")
    return engine


def connector(engine: Engine) -> Any:
    core = engine.core_actor.core
    return None if core is None else core.scheduler.connector


async def until(condition: Any, what: str, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not done in {timeout_s} s: {what}")
        await asyncio.sleep(0.005)


async def settle(engine: Engine) -> None:
    """Wait until the engine core is idle and every store (and cascade) has landed."""

    def settled() -> bool:
        core = engine.core_actor.core
        if core is None or core.has_work():
            return False
        link = connector(engine)
        if link is not None and link.stores.num_pending_chunks:
            return False
        cpu = engine.cpu_tier
        busy = cpu is not None and (
            cpu.load()["num_pending_stores"] or any(x.num_in_flight for x in cpu.links)
        )
        if busy:
            return False
        return not any(t.load().get("num_cascades_queued", 0) for t in engine.tiers.values())

    await until(settled, "the engine core and its tiers settle")


def stats(engine: Engine) -> Any:
    """The engine core's cumulative ``SchedulerStats``, with the workers' copy figures."""
    actor = engine.core_actor
    return actor.stats()


async def turn(engine: Engine, prompt: list[int], max_tokens: int, request_id: str) -> Turn:
    """One greedy request; its TTFT is the time to its first streamed token."""
    from shoal.bus.messages.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    ttft = None
    final = None
    async for output in engine.client.generate(prompt, params, request_id):
        if ttft is None and output.outputs[0].token_ids:
            ttft = time.perf_counter() - started
        final = output
    assert final is not None and ttft is not None, f"{request_id} gave no token"
    await settle(engine)
    done = final.outputs[0]
    return Turn(ttft, list(done.token_ids), final.num_cached_tokens)


def offload_options(
    model: Model, cpu_chunks: int, policy: str = "lru", **extra: Any
) -> dict[str, Any]:
    """``kv_transfer_config`` for a CPU tier of ``cpu_chunks`` chunks; ``extra``: more of its
    extra-config keys (``secondary_tiers``, ``cpu_tier_id``)."""
    options: dict[str, Any] = {
        "cpu_bytes_to_use": cpu_chunks * model.chunk_bytes,
        "eviction_policy": policy,
        "kv_lookup_timeout_s": LOOKUP_TIMEOUT_S,
        **extra,
    }
    return {
        "kv_transfer_config": {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": options,
        }
    }
