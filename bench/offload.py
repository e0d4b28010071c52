"""KV offload: how much faster a returning conversation starts when its evicted prefix loads from
the CPU or filesystem tier instead of being recomputed, how fast those loads copy, and LRU
against ARC on a scan-heavy trace.

Each engine runs in this process on an in-memory bus (workers, engine core, tier actors, the
engine client, as ``LLM`` does) on a random Llama built here (~23M parameters, ~0.6M with
``--tiny``) whose context holds the longest prompt. KV blocks of 16 tokens, one block per
offloaded chunk, greedy decoding.

1. Returning turns. Two conversations, A and B, each a first turn of ``--prefix-tokens`` random
   tokens; then ``--returns`` returning turns alternate (A, B, A, ...): the first turn, its answer
   and ``--follow-up-tokens`` new tokens. The worker pool holds one conversation only, so each
   turn evicts the other's prefix from the local prefix cache. TTFT is the time to the first
   streamed token of a returning turn, in three modes: offload off (the prefix is recomputed);
   a CPU tier holding both conversations (the prefix loads from it); a CPU tier holding one
   prefix in front of a filesystem tier (the other conversation evicted it from the CPU tier,
   so it is promoted from files, then loaded). The returning turns' ``--max-tokens`` greedy
   tokens must be the same in every mode (``outputs_equal``).
2. Load bandwidth: the engine core's ``kv_offload_load_bytes / kv_offload_load_time_s`` (the
   workers' copies from the CPU tier's shared memory into the KV cache) in the CPU mode, beside
   a large ``torch`` copy from host memory into the same device (``--memcpy-mib``), timed right
   after the CPU mode (the best of 5), so both see the same load on the machine.
3. LRU vs ARC: ``--hot`` prefixes of ``--trace-prefix-tokens`` are each asked twice to warm up,
   then for ``--rounds`` rounds each comes back once after ``--scans-per-hot`` one-off "scan"
   prefixes; the CPU tier holds ``--hot`` + 1 prefixes, so the scans between two returns of a
   hot prefix outgrow it. Every request is a prefix and 16 fresh tokens, one output token. Hit
   rate = ``kv_offload_hits / kv_offload_queries`` (tokens) over the rounds; the hot returns'
   mean TTFT beside it. The trace is the same for both policies (seeded).

Targets (issue 14, reported, not asserted): CPU tier TTFT >= 10x faster than recompute for an
8k-token prefix; loads at >= 50% of memory-copy bandwidth; ARC hit rate >= LRU's.

    .venv/bin/python bench/offload.py [--quick] [--prefix-tokens 8192] [--fs-path DIR]
    shoal bench offload [--quick] ...

The last line printed is one JSON object: ``ttft_ms`` ({"recompute", "cpu", "fs"}: mean over
the returning turns), ``cpu_speedup``, ``load_gbps``, ``memcpy_gbps``, ``load_vs_memcpy``,
``hit_rate_lru``, ``hit_rate_arc``, ``ttft_hot_ms_lru``, ``ttft_hot_ms_arc``,
``outputs_equal`` and the figures behind them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
import uuid
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.throughput import VOCAB

BLOCK_SIZE = 16  # tokens per KV block and per offloaded chunk
FIRST_TOKEN = 3  # ids below are pad, bos, eos
SUFFIX_TOKENS = 16  # fresh tokens after a trace prefix
LOOKUP_TIMEOUT_S = 30.0  # a long prefix promoted from files (half of it) must not time out
SETTLE_TIMEOUT_S = 120.0
MODES = ("recompute", "cpu", "fs")
POLICIES = ("lru", "arc")


@dataclass(frozen=True)
class Model:
    path: Path
    num_params: int
    kv_bytes_per_token: int  # every layer's K and V


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


# ----- one engine in this process


@dataclass
class Engine:
    client: Any  # AsyncEngineClient
    core_actor: Any  # EngineCoreActor
    cpu_tier: Any  # CpuTierActor or None
    fs_tier: Any  # FsTierActor or None


@dataclass(frozen=True)
class Turn:
    ttft_s: float
    token_ids: list[int]
    num_cached_tokens: int  # local prefix-cache hit + tokens loaded from the tiers


async def open_engine(
    stack: AsyncExitStack, model: Model, args: argparse.Namespace, **options: Any
) -> Engine:
    """Workers, engine core and tiers on a fresh in-memory bus, a ready client."""
    from shoal.bus import make_bus
    from shoal.deploy.deployment import build_config, plan_actors, start_in_process, stop_in_process
    from shoal.engine.client.engine_client import AsyncEngineClient

    tag = uuid.uuid4().hex[:8]
    config = build_config(
        model=str(model.path),
        bus="memory",
        namespace=f"bench-offload-{tag}",
        dtype="float32",
        device=args.device,
        block_size=BLOCK_SIZE,
        max_model_len=args.max_model_len,
        **options,
    )
    bus = make_bus(f"memory://bench-offload-{tag}")
    await bus.connect()
    stack.push_async_callback(bus.close)
    actors = await start_in_process(bus, plan_actors(config))
    stack.push_async_callback(stop_in_process, actors)
    client = AsyncEngineClient(bus, config)
    await client.start()
    stack.push_async_callback(client.close)
    await client.wait_until_ready(300, num_engines=1)
    by_kind = {type(actor).__name__: actor for actor in actors}
    engine = Engine(
        client,
        by_kind["EngineCoreActor"],
        by_kind.get("CpuTierActor"),
        by_kind.get("FsTierActor"),
    )
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
    """Wait until the engine core is idle and every store (and cascade to files) has landed."""

    def settled() -> bool:
        core = engine.core_actor.core
        if core is None or core.has_work():
            return False
        link = connector(engine)
        if link is not None and link.stores.num_pending_chunks:
            return False
        if engine.cpu_tier is not None:
            tier = engine.cpu_tier.load()
            if tier["num_pending_stores"] or any(x.num_in_flight for x in engine.cpu_tier.links):
                return False
        return engine.fs_tier is None or not engine.fs_tier.load()["num_cascades_queued"]

    await until(settled, "the engine core and its tiers settle")


def stats(engine: Engine) -> Any:
    """The engine core's cumulative ``SchedulerStats``, with the workers' copy figures."""
    actor = engine.core_actor
    return actor._stats(actor.core)


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


# ----- 1 and 2: returning turns, load bandwidth


def offload_options(
    model: Model, cpu_chunks: int, policy: str = "lru", fs: tuple[Path, int] | None = None
) -> dict[str, Any]:
    """``kv_transfer_config`` for a CPU tier of ``cpu_chunks`` chunks (and a filesystem tier
    at ``fs = (path, bytes)``)."""
    extra: dict[str, Any] = {
        "cpu_bytes_to_use": cpu_chunks * BLOCK_SIZE * model.kv_bytes_per_token,
        "eviction_policy": policy,
        "kv_lookup_timeout_s": LOOKUP_TIMEOUT_S,
    }
    if fs is not None:
        extra["secondary_tiers"] = [{"type": "fs", "path": str(fs[0]), "bytes_to_use": fs[1]}]
    return {
        "kv_transfer_config": {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    }


def conversation_options(model: Model, args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """A worker pool of one returning turn (so each turn evicts the other conversation) and the
    mode's tiers: the CPU tier holds both conversations, or (``fs``) one prefix exactly."""
    turn_tokens = args.prefix_tokens + 2 * args.max_tokens + args.follow_up_tokens
    options: dict[str, Any] = {"num_gpu_blocks_override": blocks_for(turn_tokens) + 1}
    prefix_chunks = args.prefix_tokens // BLOCK_SIZE
    if mode == "cpu":
        options |= offload_options(model, 2 * blocks_for(turn_tokens) + 8)
    elif mode == "fs":
        fs_bytes = 4 * blocks_for(turn_tokens) * BLOCK_SIZE * model.kv_bytes_per_token
        fs_dir = Path(args.fs_path) / f"fs-{uuid.uuid4().hex[:8]}"
        options |= offload_options(model, prefix_chunks, fs=(fs_dir, fs_bytes))
    return options


async def returning_turns(model: Model, args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """Both first turns, then the returning turns alternating; their TTFTs, tokens, stats."""
    rng = random.Random(args.seed)
    firsts = [random_tokens(rng, args.prefix_tokens) for _ in range(2)]
    follow_ups = [random_tokens(rng, args.follow_up_tokens) for _ in range(args.returns)]
    async with AsyncExitStack() as stack:
        engine = await open_engine(stack, model, args, **conversation_options(model, args, mode))
        answers = []
        for i, first in enumerate(firsts):
            answers.append((await turn(engine, first, args.max_tokens, f"first-{i}")).token_ids)
        before = stats(engine)
        returns = []
        for n, follow_up in enumerate(follow_ups):
            prompt = [*firsts[n % 2], *answers[n % 2], *follow_up]
            returns.append(await turn(engine, prompt, args.max_tokens, f"return-{n}"))
        after = stats(engine)
        tier = engine.cpu_tier.load() if engine.cpu_tier is not None else {}
    ttfts = [r.ttft_s * 1000 for r in returns]
    load_s = after.kv_offload_load_time_s - before.kv_offload_load_time_s
    load_bytes = after.kv_offload_load_bytes - before.kv_offload_load_bytes
    return {
        "ttft_ms": statistics.fmean(ttfts),
        "ttft_ms_each": [round(t, 1) for t in ttfts],
        "outputs": [r.token_ids for r in returns],
        "cached_tokens": [r.num_cached_tokens for r in returns],
        "hit_tokens": after.kv_offload_hits - before.kv_offload_hits,
        "load_bytes": load_bytes,
        "load_gbps": load_bytes / load_s / 1e9 if load_s > 0 else None,
        "promoted_chunks": int(tier.get("num_promoted", 0)),
        "cascade_dropped_chunks": int(tier.get("num_cascade_dropped", 0)),
    }


def memcpy_gbps(device: str, num_bytes: int, repeats: int = 5) -> float:
    """The best of ``repeats`` copies of ``num_bytes`` from host memory into ``device``: what a
    load from the CPU tier's shared memory into the KV cache could reach at most."""
    import torch

    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(repeats + 1):  # the first one faults the pages in: not counted
        if device != "cpu":
            torch.cuda.synchronize()
        started = time.perf_counter()
        dst.copy_(src)
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return num_bytes / min(times[1:]) / 1e9


# ----- 3: LRU vs ARC on a scan-heavy trace


@dataclass(frozen=True)
class TraceRequest:
    name: str  # hot-<i>-<n> or scan-<n>
    prompt: list[int]
    timed: bool  # in the rounds (not the warm-up)

    @property
    def is_hot(self) -> bool:
        return self.name.startswith("hot")


def scan_trace(args: argparse.Namespace) -> list[TraceRequest]:
    """Warm-up: every hot prefix twice (one other request between: the local cache lost it,
    the CPU tier still holds it). Rounds: each hot prefix after ``scans_per_hot`` scans."""
    rng = random.Random(args.seed + 1)
    hot = [random_tokens(rng, args.trace_prefix_tokens) for _ in range(args.hot)]
    trace, seen = [], dict.fromkeys(range(args.hot), 0)

    def ask_hot(i: int, timed: bool) -> None:
        suffix = random_tokens(rng, SUFFIX_TOKENS)
        trace.append(TraceRequest(f"hot-{i}-{seen[i]}", [*hot[i], *suffix], timed))
        seen[i] += 1

    for _ in range(2):
        for i in range(args.hot):
            ask_hot(i, timed=False)
    num_scans = 0
    for _ in range(args.rounds):
        for i in range(args.hot):
            for _ in range(args.scans_per_hot):
                prompt = random_tokens(rng, args.trace_prefix_tokens + SUFFIX_TOKENS)
                trace.append(TraceRequest(f"scan-{num_scans}", prompt, timed=True))
                num_scans += 1
            ask_hot(i, timed=True)
    return trace


async def run_trace(
    model: Model, args: argparse.Namespace, policy: str, trace: list[TraceRequest]
) -> dict[str, Any]:
    """The trace through a worker pool of one request and a CPU tier of ``hot`` + 1 of them."""
    request_blocks = blocks_for(args.trace_prefix_tokens + SUFFIX_TOKENS + 1)
    options = offload_options(model, (args.hot + 1) * request_blocks, policy)
    async with AsyncExitStack() as stack:
        engine = await open_engine(
            stack, model, args, num_gpu_blocks_override=request_blocks + 1, **options
        )
        hot_ttfts, hot_outputs = [], []
        before = None
        for request in trace:
            if request.timed and before is None:
                before = stats(engine)
            done = await turn(engine, request.prompt, 1, f"{policy}-{request.name}")
            if request.timed and request.is_hot:
                hot_ttfts.append(done.ttft_s * 1000)
                hot_outputs.append(done.token_ids)
        after = stats(engine)
    assert before is not None
    queries = after.kv_offload_queries - before.kv_offload_queries
    hits = after.kv_offload_hits - before.kv_offload_hits
    return {
        "hit_rate": hits / queries if queries else 0.0,
        "hit_tokens": hits,
        "query_tokens": queries,
        "ttft_hot_ms": statistics.fmean(hot_ttfts),
        "hot_outputs": hot_outputs,
    }


# ----- the whole run


async def run_all(model: Model, args: argparse.Namespace) -> dict[str, Any]:
    modes, memcpy = {}, 0.0
    for mode in MODES:
        modes[mode] = await returning_turns(model, args, mode)
        print(f"{mode}: returning-turn TTFT {modes[mode]['ttft_ms_each']} ms", flush=True)
        if mode == "cpu":  # right after its loads, under the same load on the machine
            memcpy = memcpy_gbps(args.device, args.memcpy_mib << 20)
    trace = scan_trace(args)
    policies = {}
    for policy in POLICIES:
        policies[policy] = await run_trace(model, args, policy, trace)
        figures = policies[policy]
        print(
            f"{policy}: hit rate {figures['hit_rate']:.3f}, hot TTFT "
            f"{figures['ttft_hot_ms']:.1f} ms",
            flush=True,
        )
    return {"modes": modes, "memcpy_gbps": memcpy, "policies": policies, "trace": len(trace)}


def summarize(model: Model, args: argparse.Namespace, runs: dict[str, Any]) -> dict[str, Any]:
    modes, policies = runs["modes"], runs["policies"]
    ttft = {mode: round(modes[mode]["ttft_ms"], 2) for mode in MODES}
    load_gbps = modes["cpu"]["load_gbps"]
    memcpy = runs["memcpy_gbps"]
    reference = modes["recompute"]["outputs"]
    return {
        "ttft_ms": ttft,
        "cpu_speedup": round(ttft["recompute"] / ttft["cpu"], 2),
        "fs_speedup": round(ttft["recompute"] / ttft["fs"], 2),
        "load_gbps": round(load_gbps, 3) if load_gbps else None,
        "memcpy_gbps": round(memcpy, 3),
        "load_vs_memcpy": round(load_gbps / memcpy, 3) if load_gbps else None,
        "load_gbps_fs": round(modes["fs"]["load_gbps"] or 0.0, 3),
        "hit_rate_lru": round(policies["lru"]["hit_rate"], 4),
        "hit_rate_arc": round(policies["arc"]["hit_rate"], 4),
        "ttft_hot_ms_lru": round(policies["lru"]["ttft_hot_ms"], 2),
        "ttft_hot_ms_arc": round(policies["arc"]["ttft_hot_ms"], 2),
        "outputs_equal": all(modes[m]["outputs"] == reference for m in MODES),
        "trace_outputs_equal": policies["lru"]["hot_outputs"] == policies["arc"]["hot_outputs"],
        "ttft_ms_each": {mode: modes[mode]["ttft_ms_each"] for mode in MODES},
        "cached_tokens": {mode: modes[mode]["cached_tokens"] for mode in MODES},
        "hit_tokens": {mode: modes[mode]["hit_tokens"] for mode in MODES},
        "load_bytes": modes["cpu"]["load_bytes"],
        "fs_promoted_chunks": modes["fs"]["promoted_chunks"],
        "fs_cascade_dropped_chunks": modes["fs"]["cascade_dropped_chunks"],
        "trace_hit_tokens": {p: policies[p]["hit_tokens"] for p in POLICIES},
        "trace_query_tokens": {p: policies[p]["query_tokens"] for p in POLICIES},
        "trace_requests": runs["trace"],
        "num_params": model.num_params,
        "kv_bytes_per_token": model.kv_bytes_per_token,
        "threads": torch_threads(),
        "targets": {"cpu_speedup": 10.0, "load_vs_memcpy": 0.5, "arc_vs_lru_hit_rate": 1.0},
    }


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add = parser.add_argument
    add("--prefix-tokens", type=int, default=None, help="first-turn length (default 8192)")
    add("--follow-up-tokens", type=int, default=16, help="new tokens of a returning turn")
    add("--max-tokens", type=int, default=8, help="greedy tokens per turn (compared)")
    add("--returns", type=int, default=2, help="returning turns per mode (alternating A, B)")
    add("--trace-prefix-tokens", type=int, default=None, help="trace prefix (default 1024)")
    add("--hot", type=int, default=2, help="hot prefixes of the trace")
    add("--scans-per-hot", type=int, default=3, help="scans before each hot return")
    add("--rounds", type=int, default=None, help="trace rounds (default 4)")
    add(
        "--fs-path",
        default=None,
        help="where the filesystem tier writes (a fresh subdirectory; default: a temp dir)",
    )
    add("--memcpy-mib", type=int, default=256, help="size of the timed memory copy")
    add("--device", default=None, help="cpu or cuda (default: cuda if present)")
    add("--threads", type=int, default=None, help="torch threads (default: torch's)")
    add("--seed", type=int, default=0)
    add("--tiny", action="store_true", help="the ~0.6M Llama (smoke tests)")
    add("--quick", action="store_true", help="1k-token prefixes, 256-token trace, 2 rounds")
    args = parser.parse_args(argv)
    quick = args.quick
    if args.prefix_tokens is None:
        args.prefix_tokens = 1024 if quick else 8192
    if args.trace_prefix_tokens is None:
        args.trace_prefix_tokens = 256 if quick else 1024
    if args.rounds is None:
        args.rounds = 2 if quick else 4
    if quick:
        args.memcpy_mib = min(args.memcpy_mib, 64)
    for name in ("prefix_tokens", "trace_prefix_tokens"):  # whole chunks
        setattr(args, name, max(BLOCK_SIZE, getattr(args, name) // BLOCK_SIZE * BLOCK_SIZE))
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    longest = max(
        args.prefix_tokens + 2 * args.max_tokens + args.follow_up_tokens,
        args.trace_prefix_tokens + SUFFIX_TOKENS + 1,
    )
    args.max_model_len = longest + BLOCK_SIZE
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    print(
        f"returning turns of a {args.prefix_tokens}-token prefix ({args.returns} per mode: "
        f"{', '.join(MODES)}); LRU vs ARC on {args.hot} hot {args.trace_prefix_tokens}-token "
        f"prefixes, {args.scans_per_hot} scans before each return, {args.rounds} rounds; "
        f"device {args.device}, {torch_threads()} torch threads",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="bench-offload-") as tmp:
        if args.fs_path is None:
            args.fs_path = str(Path(tmp) / "fs")
        model_dir = Path(tmp) / "model"
        model_dir.mkdir()
        model = build_model(model_dir, args.max_model_len, args.tiny)
        runs = asyncio.run(run_all(model, args))
        figures = summarize(model, args, runs)
    print(
        f"TTFT of a returning turn: recompute {figures['ttft_ms']['recompute']} ms, CPU tier "
        f"{figures['ttft_ms']['cpu']} ms ({figures['cpu_speedup']}x, target >= 10x), "
        f"filesystem tier {figures['ttft_ms']['fs']} ms ({figures['fs_speedup']}x); outputs "
        f"equal across modes: {figures['outputs_equal']}. Loads {figures['load_gbps']} GB/s vs "
        f"memory copy {figures['memcpy_gbps']} GB/s ({figures['load_vs_memcpy']}, target >= "
        f"0.5). Scan-heavy trace hit rate LRU {figures['hit_rate_lru']}, ARC "
        f"{figures['hit_rate_arc']} (target ARC >= LRU)",
        flush=True,
    )
    skip = {"quick", "device", "threads", "fs_path"}
    print(json.dumps({**figures, **{k: v for k, v in vars(args).items() if k not in skip}}))


if __name__ == "__main__":
    main()
