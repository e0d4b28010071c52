"""Dual-batch overlap on and off: step time of an EP=2 MoE model whose expert all-to-alls run
between two processes (not a test).

Two spawned ranks (gloo on the CPU; NCCL on CUDA when there are two GPUs) load the same random
Mixtral-like checkpoint (fixed seed; hidden 256, 8 experts, top-2, 4 layers) with
``EPContext(rank, 2)``: each holds 4 experts. Every step is run both ways on the same inputs,
in alternation: the plain forward (DBO off) and ``forward_ubatched`` over two micro-batches cut
at the middle (DBO on). Figures are medians over ``--reps`` repetitions after warm-up, the
slower rank's.

**Injected link** (``EPContext.link_delay_s``, ``link_bytes_per_s``), to emulate a cross-host
EP link on a loopback gloo group (the real loopback collectives run too, underneath):

- ``--link bandwidth`` (default): each all-to-all takes ``--link-latency-us`` (20 us, an RDMA
  NIC's order) plus its bytes for the other rank at the link's bandwidth, transfers queueing on
  each rank's link, so communication grows with the tokens as it does on a real network for
  prefill-sized batches. ``--link-mb-s 0`` (default) calibrates the bandwidth so that a step of
  ``--calibrate-tokens`` (512, the default prefill threshold) spends ``--comm-share`` (1.0) x
  its compute on the link; the compute is the replicated model's forward (the same expert work
  per rank as EP, no collectives), timed on both ranks at once.
- ``--link latency``: a fixed latency per all-to-all (``--link-delay-ms``, or ``auto``: the
  three all-to-alls of each MoE layer sum to ``--comm-share`` x the compute at
  ``--calibrate-tokens``), as for decode-sized batches where latency dominates.

What to expect: with a bandwidth-bound link one micro-batch's transfer overlaps the other's
compute, so DBO gains up to about +50..100% where comm = compute; a latency-bound link does not
get faster when the step is split, so each micro-batch's chain per MoE layer is its 3 delays
plus its own compute: DBO on >= max(compute, comm + compute / 2) against comm + compute off,
at most +33% where comm = compute. Both less the split's own cost (two smaller matmuls, every
per-layer fixed cost and real collective paid twice: large below a few hundred tokens on a
2-core CPU whose two ranks also run gloo's threads).

Workloads (``--kinds``): ``prefill``, chunks of up to 128 new tokens per request from empty
contexts; ``decode``, one token per request over a 64-token context. Tokens per step are swept
over ``--tokens``. The split's thresholds (vLLM's defaults: decode 32, prefill 512 tokens) are
where DBO is meant to start paying; the ``split`` column says whether they split the step.

    .venv/bin/python bench/dbo.py [--quick] [--tokens 16,32,...] [--kinds prefill,decode]
        [--link bandwidth|latency] [--link-latency-us 20] [--link-mb-s MB/S]
        [--link-delay-ms auto|MS] [--comm-share 1.0] [--calibrate-tokens 512] [--reps 9]
    shoal bench dbo [...]

One torch thread per process. The last line printed is one JSON object: ``{"rows":
[{"kind", "tokens_per_step", "dbo_off_ms", "dbo_on_ms", "gain_pct", "off_tok_s", "on_tok_s",
"split_by_default"}, ...], "best_gain_pct", "link", "link_delay_ms", "link_mb_s",
"link_delay": "injected", "device", "load_avg"}`` (``load_avg``: the host's 1-minute load
before and after: these machines are shared, read the figures with it).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shoal.workers.dbo.thresholds import DEFAULT_PREFILL_TOKEN_THRESHOLD, check_ubatch_thresholds

BLOCK_SIZE = 16
CHUNK = 128  # prefill tokens per request
DECODE_CONTEXT = 64
MODEL = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 512,
    "initializer_range": 0.3,
}
COMM_PER_LAYER = 3  # all-to-alls per MoE layer: counts, dispatch, combine


def build_checkpoint(out_dir: Path) -> Path:
    """The random Mixtral-like checkpoint (fixed seed), saved with save_pretrained."""
    import transformers

    config = transformers.MixtralConfig(**MODEL)
    config.architectures = ["MixtralForCausalLM"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(out_dir))
    return out_dir


def step_batch(kind: str, num_tokens: int) -> tuple[list[int], list[int]]:
    """(computed, scheduled) per request for one step of ``num_tokens`` tokens."""
    if kind == "decode":
        return [DECODE_CONTEXT] * num_tokens, [1] * num_tokens
    chunks = [CHUNK] * (num_tokens // CHUNK) + ([num_tokens % CHUNK] if num_tokens % CHUNK else [])
    return [0] * len(chunks), chunks


def step_inputs(model: Any, kind: str, num_tokens: int, device: torch.device) -> tuple:
    """Input ids, positions, metadata and micro-batch slices of one step, with fresh caches
    bound (their content does not change the cost)."""
    from shoal.workers.dbo.ubatch_slices import make_ubatch_slices
    from shoal.workers.layers.attention import AttentionMetadata

    computed, scheduled = step_batch(kind, num_tokens)
    seq_lens = [c + s for c, s in zip(computed, scheduled, strict=True)]
    pages = -(-max(seq_lens) // BLOCK_SIZE)
    table = torch.arange(len(seq_lens) * pages, dtype=torch.int32).reshape(len(seq_lens), pages)
    for layer in model.attention_layers():
        shape = (len(seq_lens) * pages, BLOCK_SIZE, layer.num_kv_heads, model.config.head_dim)
        layer.bind_cache(torch.zeros(shape, device=device), torch.zeros(shape, device=device))
    positions = torch.cat(
        [torch.arange(c, c + s) for c, s in zip(computed, scheduled, strict=True)]
    )
    rows = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(scheduled))
    slots = table[rows, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    qsl = torch.zeros(len(scheduled) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(scheduled).cumsum(0)
    meta = AttentionMetadata(
        slot_mapping=slots.to(device),
        block_tables=table.to(device),
        query_start_loc=qsl.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        max_query_len=max(scheduled),
        max_seq_len=max(seq_lens),
    )
    gen = torch.Generator().manual_seed(num_tokens)
    ids = torch.randint(model.config.vocab_size, (num_tokens,), generator=gen).to(device)
    return ids, positions.to(device), meta, make_ubatch_slices(scheduled, num_tokens)


def time_pair(model: Any, inputs: tuple, reps: int, warmup: int, device: torch.device) -> tuple:
    """Median ms of the plain forward and of ``forward_ubatched``, timed in alternation; every
    rank runs the same calls (the all-to-alls are collective)."""
    import torch.distributed as dist

    from shoal.workers.dbo.forward import forward_ubatched

    ids, positions, meta, slices = inputs
    calls = (
        lambda: model(ids, positions, meta),
        lambda: forward_ubatched(model, ids, positions, meta, slices),
    )
    samples: tuple[list[float], list[float]] = ([], [])
    for rep in range(warmup + reps):
        for call, out in zip(calls, samples, strict=True):
            dist.barrier()
            start = time.perf_counter()
            with torch.inference_mode():
                call()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if rep >= warmup:
                out.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples[0]), statistics.median(samples[1])


def slowest(value: float, device: torch.device) -> float:
    """The largest of every rank's ``value``."""
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def rank_main(rank: int, port: int, cfg: dict[str, Any], answers: Any) -> None:
    """One EP rank: calibrate the delay (unless given), then the sweep."""
    try:
        answers.put((rank, run_rank(rank, port, cfg)))
    except BaseException as exc:  # reported by the parent
        answers.put((rank, repr(exc)))


def time_compute(model: Any, inputs: tuple, reps: int, device: torch.device) -> float:
    """Median ms of the plain forward of a model without collectives, both ranks at once (so
    they contend for the host as in the sweep)."""
    import torch.distributed as dist

    ids, positions, meta, _ = inputs
    samples = []
    for rep in range(2 + reps):
        dist.barrier()
        start = time.perf_counter()
        with torch.inference_mode():
            model(ids, positions, meta)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if rep >= 2:
            samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def calibrate_delay(cfg: dict[str, Any], device: torch.device) -> tuple[float, float]:
    """``auto``: (delay in s, compute in ms): a step's compute is the replicated model's
    forward at ``calibrate_tokens`` (every expert here: the same expert work per rank as EP,
    without communication), and the injected comm of a step is ``comm_share`` of it."""
    from shoal.workers.loader import load_model

    full = load_model(cfg["model_dir"], dtype=torch.float32, device=device)[0]
    inputs = step_inputs(full, cfg["kinds"][0], cfg["calibrate_tokens"], device)
    compute_ms = slowest(time_compute(full, inputs, cfg["reps"], device), device)
    num_comm = COMM_PER_LAYER * MODEL["num_hidden_layers"]
    return cfg["comm_share"] * compute_ms / 1e3 / num_comm, compute_ms


def bytes_per_step(cfg: dict[str, Any], rank: int, device: torch.device) -> float:
    """Bytes this rank sends to the other in one step at ``calibrate_tokens`` (dispatch and
    combine rows; the largest of the two ranks')."""
    from shoal.workers.loader import load_model
    from shoal.workers.moe.expert_parallel import INJECTED_LINK, EPContext

    probe = load_model(cfg["model_dir"], dtype=torch.float32, device=device,
                       ep=EPContext(rank, 2))[0]  # fmt: skip
    ids, positions, meta, _ = step_inputs(probe, cfg["kinds"][0], cfg["calibrate_tokens"], device)
    before, INJECTED_LINK.counting = INJECTED_LINK.bytes_sent, True
    with torch.inference_mode():
        probe(ids, positions, meta)
    INJECTED_LINK.counting = False
    return slowest(float(INJECTED_LINK.bytes_sent - before), device)


def link_for(cfg: dict[str, Any], rank: int, device: torch.device) -> tuple[Any, Any]:
    """(this rank's EPContext with the injected link, calibration facts or None)."""
    from shoal.workers.moe.expert_parallel import EPContext

    latency_s = cfg["link_latency_us"] / 1e6
    if cfg["link"] == "bandwidth":
        delay_s, compute_ms = latency_s, None
        bandwidth = cfg["link_mb_s"] * 1e6 if cfg["link_mb_s"] else 0.0
        if not bandwidth:
            compute_ms = calibrate_delay(cfg, device)[1]
            num_bytes = bytes_per_step(cfg, rank, device)
            num_comm = COMM_PER_LAYER * MODEL["num_hidden_layers"]
            transfer_s = cfg["comm_share"] * compute_ms / 1e3 - num_comm * latency_s
            bandwidth = num_bytes / max(transfer_s, 1e-6)
        ep = EPContext(rank, 2, link_delay_s=delay_s, link_bytes_per_s=bandwidth)
        return ep, compute_ms
    compute_ms = None
    if cfg["link_delay_ms"] is None:
        delay_s, compute_ms = calibrate_delay(cfg, device)
    else:
        delay_s = cfg["link_delay_ms"] / 1e3
    return EPContext(rank, 2, link_delay_s=delay_s), compute_ms


def run_rank(rank: int, port: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from shoal.workers.loader import load_model

    torch.set_num_threads(1)
    device = torch.device(f"cuda:{rank}" if cfg["device"] == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    init = f"tcp://127.0.0.1:{port}"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=2)
    ep, compute_ms = link_for(cfg, rank, device)
    delay_s = ep.link_delay_s
    model = load_model(cfg["model_dir"], dtype=torch.float32, device=device, ep=ep)[0]
    rows = []
    for kind in cfg["kinds"]:
        for n in cfg["tokens"]:
            inputs = step_inputs(model, kind, n, device)
            off, on = time_pair(model, inputs, cfg["reps"], cfg["warmup"], device)
            rows.append((kind, n, slowest(off, device), slowest(on, device)))
    dist.destroy_process_group()
    return {
        "rows": rows,
        "delay_ms": delay_s * 1e3,
        "link_mb_s": ep.link_bytes_per_s / 1e6,
        "calibration_ms": compute_ms,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(cfg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    answers = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, port, cfg, answers)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        results = dict(answers.get(timeout=timeout_s) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank, result in sorted(results.items()):
        if not isinstance(result, dict):
            raise SystemExit(f"rank {rank} failed: {result}")
    return results[0]


def report(result: dict[str, Any], cfg: dict[str, Any], load_avg: list[float]) -> dict[str, Any]:
    """Print the table; the JSON summary."""
    delay_ms = result["delay_ms"]
    num_comm = COMM_PER_LAYER * MODEL["num_hidden_layers"]
    if cfg["link"] == "bandwidth":
        print(
            f"EP=2 over two processes ({cfg['device']}); INJECTED link: {delay_ms * 1e3:.0f} us "
            f"latency per all-to-all + {result['link_mb_s']:.2f} MB/s per rank for the bytes "
            "sent to the other rank (transfers queue on the link)"
        )
    else:
        print(
            f"EP=2 over two processes ({cfg['device']}); INJECTED link latency {delay_ms:.3f} "
            f"ms per all-to-all, {COMM_PER_LAYER} per MoE layer x "
            f"{MODEL['num_hidden_layers']} layers = {num_comm * delay_ms:.2f} ms per step"
        )
    if result["calibration_ms"] is not None:
        print(
            f"auto: {cfg['comm_share']} x the compute of a step of {cfg['calibrate_tokens']} "
            f"{cfg['kinds'][0]} tokens ({result['calibration_ms']:.2f} ms, replicated model)"
        )
    print(f"host load average before/after: {load_avg[0]:.2f} / {load_avg[1]:.2f}")
    header = ("kind", "tokens", "split", "off ms", "on ms", "gain %", "off tok/s", "on tok/s")
    print("".join(f"{h:>10}" for h in header))
    rows = []
    for kind, n, off, on in result["rows"]:
        split = check_ubatch_thresholds(n, uniform_decode=kind == "decode")
        row = {
            "kind": kind,
            "tokens_per_step": n,
            "dbo_off_ms": round(off, 3),
            "dbo_on_ms": round(on, 3),
            "gain_pct": round(100.0 * (off / on - 1.0), 1),
            "off_tok_s": round(n / off * 1e3),
            "on_tok_s": round(n / on * 1e3),
            "split_by_default": split,
        }
        rows.append(row)
        cells = (kind, n, "yes" if split else "no", f"{off:.2f}", f"{on:.2f}")
        cells += (row["gain_pct"], row["off_tok_s"], row["on_tok_s"])
        print("".join(f"{c:>10}" for c in cells))
    return {
        "rows": rows,
        "best_gain_pct": max(r["gain_pct"] for r in rows),
        "link": cfg["link"],
        "link_delay_ms": round(delay_ms, 4),
        "link_mb_s": round(result["link_mb_s"], 3),
        "link_delay": "injected",
        "device": cfg["device"],
        "load_avg": [round(x, 2) for x in load_avg],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="16,32,64,128,256,512,1024")
    parser.add_argument("--kinds", default="prefill,decode")
    parser.add_argument(
        "--link",
        choices=("bandwidth", "latency"),
        default="bandwidth",
        help="injected link: latency + bytes / bandwidth, or a fixed latency",
    )
    parser.add_argument(
        "--link-latency-us", type=float, default=20.0, help="bandwidth link: latency per all-to-all"
    )
    parser.add_argument(
        "--link-mb-s",
        type=float,
        default=0.0,
        help="bandwidth link: MB/s per rank (0: auto, from --comm-share)",
    )
    parser.add_argument(
        "--link-delay-ms",
        default="auto",
        help="latency link: the latency, or auto (from --comm-share)",
    )
    parser.add_argument("--comm-share", type=float, default=1.0, help="auto: comm / compute")
    parser.add_argument("--calibrate-tokens", type=int, default=DEFAULT_PREFILL_TOKEN_THRESHOLD)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--quick", action="store_true", help="3 sizes, prefill only, 3 reps")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.kinds, args.reps, args.warmup = "32,128,512", "prefill", 3, 1
    tokens = [int(t) for t in args.tokens.split(",")]
    two_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    device = ("cuda" if two_gpus else "cpu") if args.device == "auto" else args.device
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = {
            "model_dir": str(build_checkpoint(Path(tmp) / "mixtral")),
            "tokens": tokens,
            "kinds": args.kinds.split(","),
            "link": args.link,
            "link_latency_us": args.link_latency_us,
            "link_mb_s": args.link_mb_s,
            "link_delay_ms": None if args.link_delay_ms == "auto" else float(args.link_delay_ms),
            "comm_share": args.comm_share,
            "calibrate_tokens": args.calibrate_tokens,
            "reps": args.reps,
            "warmup": args.warmup,
            "device": device,
        }
        result = run_ranks(cfg, timeout_s=600.0)
    summary = report(result, cfg, [load_before, os.getloadavg()[0]])
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
