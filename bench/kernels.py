"""Kernel timings: each op's torch reference beside its Triton kernel (not a test).

On a CUDA machine with Triton both paths run on the GPU (default bf16, serving-sized shapes); on
the CPU only the torch path runs (default fp32, shapes sized for a ~25M-parameter model), since
Triton on the CPU means the interpreter. Each figure is the median of ``--iters`` timed calls
after warm-up; on CUDA the Triton output is also checked against the torch output.

    .venv/bin/python bench/kernels.py [--device cuda|cpu] [--dtype bf16|fp16|fp32] [--iters 20]
        [--layouts-only]

First a table of the torch decode attention, one SDPA per sequence (before) against the sparse
products of ``sparse_decode`` (after; fp32 only, other dtypes show the same path twice), timed
in alternation for four page layouts (consecutive, a consecutive run plus a short or a long
scattered tail, fully scattered) and two head shapes. The last line printed is one JSON
object: ``{"device", "dtype", "decode_layouts": [{"heads", "layout", "before_ms", "after_ms",
"plan_ms", "speedup", "max_abs_diff"}, ...], "ops": [{"op", "shape", "torch_ms", "triton_ms",
"speedup", "max_abs_diff"}, ...]}`` (Triton fields null on the CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shoal.kernels import activation, fused_moe, kv_write, rms_norm, rotary
from shoal.kernels._triton import HAS_TRITON
from shoal.kernels.decode_attention import decode_attention_triton
from shoal.kernels.varlen_attention import (
    plan_varlen_torch,
    varlen_attention_torch,
    varlen_attention_triton,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _time_ms(fn: Callable[[], Any], device: torch.device, iters: int) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _time_pair_ms(
    first: Callable[[], Any], second: Callable[[], Any], iters: int
) -> tuple[float, float]:
    """Medians of two CPU functions timed in alternation (so drifts in load and allocator
    state hit both alike)."""
    samples: tuple[list[float], list[float]] = ([], [])
    for i in range(iters + 3):
        for fn, out in ((first, samples[0]), (second, samples[1])):
            start = time.perf_counter()
            fn()
            if i >= 3:  # warm-up
                out.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples[0]), statistics.median(samples[1])


def _max_diff(a: Any, b: Any) -> float:
    if isinstance(a, tuple):
        return max(_max_diff(x, y) for x, y in zip(a, b, strict=True))
    if a is None:
        return 0.0
    return float((a.float() - b.float()).abs().max())


def _paged_inputs(
    query_lens: list[int],
    context_lens: list[int],
    hq: int,
    hkv: int,
    dim: int,
    dev: torch.device,
    dtype: torch.dtype,
    shuffle: bool = True,
    tail_pages: int = 0,
) -> tuple:
    """Pages shuffled, or each sequence's in one consecutive run; with ``tail_pages``, each
    sequence's last pages (up to that many) are scattered after the runs (decode growth)."""
    block_size = 16
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    pages = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(pages) + 1
    k_cache = torch.randn(num_blocks, block_size, hkv, dim, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks) if shuffle else torch.arange(num_blocks)
    perm = perm.to(torch.int32).to(dev)
    table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32, device=dev)
    tails = [min(tail_pages, n - 1) for n in pages]
    taken = 0
    for s, n in enumerate(pages):
        table[s, : n - tails[s]] = perm[taken : taken + n - tails[s]]
        taken += n - tails[s]
    scattered = perm[taken:][torch.randperm(num_blocks - taken)]  # tails, interleaved
    for s, n in enumerate(pages):
        table[s, n - tails[s] : n] = scattered[: tails[s]]
        scattered = scattered[tails[s] :]
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    q = torch.randn(starts[-1], hq, dim, device=dev, dtype=dtype)
    qsl = torch.tensor(starts, dtype=torch.int32, device=dev)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    return q, k_cache, v_cache, table, qsl, lens, dim**-0.5


def _decode_triton(q, k, v, table, qsl, lens, scale):  # type: ignore[no-untyped-def]
    """The decode kernel on the attention cases' inputs (it takes no query starts)."""
    return decode_attention_triton(q, k, v, table, lens, scale)


def _varlen_triton(q, k, v, table, qsl, lens, scale):  # type: ignore[no-untyped-def]
    """The varlen kernel on the attention cases' inputs."""
    max_query_len = int((qsl[1:] - qsl[:-1]).max())
    return varlen_attention_triton(q, k, v, table, qsl, lens, scale, max_query_len)


def _plan_torch(q, k, table, qsl, lens):  # type: ignore[no-untyped-def]
    """The torch varlen path's plan, made once per step in serving."""
    return plan_varlen_torch(table, qsl, lens, k, q.shape[1])


def _cases(dev: torch.device, dtype: torch.dtype, big: bool) -> list[tuple[str, str, tuple, Any]]:
    """(op name, shape text, args, module or (torch, triton) functions) for every benchmarked
    op. Attention times the kernels ``ops.paged_attention`` picks: on torch the varlen path,
    on Triton the decode kernel for all-decode batches, else the varlen kernel."""
    hq, hkv, dim = (32, 8, 128) if big else (8, 4, 64)
    tokens, hidden, inter = (4096, 4096, 14336) if big else (512, 512, 1536)
    seqs, ctx = (64, 2048) if big else (64, 512)
    g = torch.Generator(device="cpu").manual_seed(0)
    ctx_lens = torch.randint(ctx // 4, ctx, (seqs,), generator=g).tolist()
    decode = _paged_inputs([1] * seqs, ctx_lens, hq, hkv, dim, dev, dtype)
    decode_runs = _paged_inputs([1] * seqs, ctx_lens, hq, hkv, dim, dev, dtype, shuffle=False)
    chunk = 512 if big else 128
    prefill = _paged_inputs([chunk] * 4, [chunk] * 4, hq, hkv, dim, dev, dtype)
    x = torch.randn(tokens, hidden, device=dev, dtype=dtype)
    weight = torch.randn(hidden, device=dev, dtype=dtype)
    gate_up = torch.randn(tokens, 2 * inter, device=dev, dtype=dtype)
    q = torch.randn(tokens, hq, dim, device=dev, dtype=dtype)
    k = torch.randn(tokens, hkv, dim, device=dev, dtype=dtype)
    positions = torch.randint(0, 4096, (tokens,), device=dev)
    cache = rotary.build_cos_sin_cache(dim, 4096, 10000.0).to(dev)
    experts, top_k, moe_tokens, moe_hidden, moe_inter = (
        (64, 8, 512, 2048, 768) if big else (8, 2, 128, 512, 768)
    )
    moe_x = torch.randn(moe_tokens, moe_hidden, device=dev, dtype=dtype)
    w13 = torch.randn(experts, 2 * moe_inter, moe_hidden, device=dev, dtype=dtype) * 0.02
    w2 = torch.randn(experts, moe_hidden, moe_inter, device=dev, dtype=dtype) * 0.02
    topk = torch.rand(moe_tokens, experts, device=dev).topk(top_k, dim=-1)
    kv_cache_pair = (decode[1], decode[2])
    dec, varlen = (varlen_attention_torch, _decode_triton), (varlen_attention_torch, _varlen_triton)
    slots = torch.randperm(decode[1].shape[0] * 16, device=dev)[:tokens]
    return [
        ("write_kv", f"T={tokens} hkv={hkv} d={dim}", (k, k, *kv_cache_pair, slots), kv_write),
        ("paged_attention decode", f"S={seqs} ctx<{ctx} hq={hq} hkv={hkv} d={dim}", decode, dec),
        ("paged_attention decode", "same, pages in consecutive runs", decode_runs, dec),
        ("paged_attention prefill", f"4x{chunk} over {chunk} prefix", prefill, varlen),
        ("rms_norm+residual", f"T={tokens} h={hidden}", (x, weight, 1e-6, x), rms_norm),
        ("apply_rotary", f"T={tokens} hq={hq} hkv={hkv} d={dim}", (q, k, positions, cache), rotary),
        ("silu_and_mul", f"T={tokens} i={inter}", (gate_up,), activation),
        (
            "fused_moe",
            f"T={moe_tokens} E={experts} k={top_k} h={moe_hidden} i={moe_inter}",
            (moe_x, w13, w2, topk.values, topk.indices),
            fused_moe,
        ),
    ]


def _fns(name: str, module: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
    if isinstance(module, tuple):
        return module
    pairs = {
        "write_kv": ("write_kv_torch", "write_kv_triton"),
        "rms_norm+residual": ("rms_norm_torch", "rms_norm_triton"),
        "apply_rotary": ("apply_rotary_torch", "apply_rotary_triton"),
        "silu_and_mul": ("silu_and_mul_torch", "silu_and_mul_triton"),
        "fused_moe": ("fused_moe_torch", "fused_moe_triton"),
    }
    ref, tri = pairs[name]
    return getattr(module, ref), getattr(module, tri)


def _decode_layouts(dev: torch.device, dtype: torch.dtype, iters: int) -> list[dict]:
    """The torch decode path before (one SDPA per sequence over a view or a slice of one
    full gather) and after (``sparse_decode``: sampled QKᵀ and P·V over the whole cache for all
    decodes), each with its plan made once per step as in serving, for the page layouts a
    decode batch sees and two head shapes (the throughput bench's model, a Llama-3-8B layer)."""
    from shoal.kernels.paged_common import plan_context_reads
    from shoal.kernels.varlen_attention import TorchAttentionPlan

    def per_sequence_plan(q, k, table, qsl, lens):  # type: ignore[no-untyped-def]
        reads = plan_context_reads(table, lens.tolist(), k.shape[1])
        return TorchAttentionPlan(None, list(range(len(lens))), qsl.tolist(), reads)

    g = torch.Generator(device="cpu").manual_seed(0)
    seqs, ctx = 64, 512
    ctx_lens = torch.randint(ctx // 4, ctx, (seqs,), generator=g).tolist()
    layouts = {
        "consecutive": {"shuffle": False},
        "run + 3-page tail": {"shuffle": False, "tail_pages": 3},
        "run + 10-page tail": {"shuffle": False, "tail_pages": 10},
        "scattered": {"shuffle": True},
    }
    rows = []
    print(f"decode S={seqs} ctx<{ctx}, one layer, the step's plan made once")
    print(
        f"{'heads q/kv/d':<14}{'layout':<22}{'before ms':>10}{'after ms':>10}{'speedup':>9}"
        f"{'max diff':>10}{'plan ms':>9}"
    )
    for hq, hkv, dim in ((8, 4, 64), (32, 8, 128)):
        for name, how in layouts.items():
            inputs = _paged_inputs([1] * seqs, ctx_lens, hq, hkv, dim, dev, dtype, **how)
            q, k, _, table, qsl, lens, _ = inputs
            plans = [make(q, k, table, qsl, lens) for make in (per_sequence_plan, _plan_torch)]
            before, after = (
                lambda plan=plan, inputs=inputs: varlen_attention_torch(*inputs, plan=plan)
                for plan in plans
            )
            before_ms, after_ms = _time_pair_ms(before, after, iters)
            plan_ms = _time_ms(
                lambda q=q, k=k, table=table, qsl=qsl, lens=lens: _plan_torch(
                    q, k, table, qsl, lens
                ),
                dev,
                iters,
            )
            diff = _max_diff(after(), before())
            speedup = before_ms / after_ms
            heads = f"{hq}/{hkv}/{dim}"
            print(
                f"{heads:<14}{name:<22}{before_ms:>10.3f}{after_ms:>10.3f}{speedup:>8.2f}x"
                f"{diff:>10.2e}{plan_ms:>9.3f}"
            )
            rows.append(
                {
                    "heads": heads,
                    "layout": name,
                    "before_ms": round(before_ms, 4),
                    "after_ms": round(after_ms, 4),
                    "plan_ms": round(plan_ms, 4),
                    "speedup": round(speedup, 2),
                    "max_abs_diff": diff,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument(
        "--layouts-only", action="store_true", help="only the torch decode page-layout table"
    )
    args = parser.parse_args()
    dev = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bf16" if dev.type == "cuda" else "fp32")]
    run_triton = dev.type == "cuda" and HAS_TRITON
    torch.manual_seed(0)
    layouts = _decode_layouts(dev, dtype, args.iters)
    if args.layouts_only:
        print(json.dumps({"device": str(dev), "dtype": str(dtype), "decode_layouts": layouts}))
        return
    rows = []
    print(f"{'op':<26}{'shape':<44}{'torch ms':>10}{'triton ms':>11}{'speedup':>9}{'max diff':>10}")
    for name, shape, inputs, module in _cases(dev, dtype, big=dev.type == "cuda"):
        ref, tri = _fns(name, module)
        torch_ms = _time_ms(lambda ref=ref, inputs=inputs: ref(*inputs), dev, args.iters)
        triton_ms = diff = None
        if run_triton:
            triton_ms = _time_ms(lambda tri=tri, inputs=inputs: tri(*inputs), dev, args.iters)
            diff = _max_diff(tri(*inputs), ref(*inputs))
        speedup = torch_ms / triton_ms if triton_ms else None
        rows.append(
            {
                "op": name,
                "shape": shape,
                "torch_ms": round(torch_ms, 4),
                "triton_ms": None if triton_ms is None else round(triton_ms, 4),
                "speedup": None if speedup is None else round(speedup, 2),
                "max_abs_diff": diff,
            }
        )
        tri_text = "-" if triton_ms is None else f"{triton_ms:.3f}"
        sp_text = "-" if speedup is None else f"{speedup:.2f}x"
        diff_text = "-" if diff is None else f"{diff:.2e}"
        print(f"{name:<26}{shape:<44}{torch_ms:>10.3f}{tri_text:>11}{sp_text:>9}{diff_text:>10}")
    result = {"device": str(dev), "dtype": str(dtype), "decode_layouts": layouts, "ops": rows}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
