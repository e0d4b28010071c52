"""The model forward over micro-batches (``forward_ubatched``) against the plain forward of the
same step over the same paged cache: one process for a dense model and replicated experts (no
yield), and two gloo processes for EP=2 Mixtral, Qwen2-MoE and Qwen3-MoE models (the
all-to-alls yield, the micro-batches alternate strictly), also against the replicated model.

Every step mixes a prefill chunk cut by the split (its second part attends to the first part's
KV written by micro-batch 0 in this step), decodes, and requests whose earlier tokens are
already in the paged cache."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shoal.workers.dbo.forward import SplitCounts, forward_ubatched
from shoal.workers.dbo.ubatch_slices import UBatchSlice, make_ubatch_slices
from shoal.workers.dbo.ubatching import current_ubatch_id
from shoal.workers.layers.attention import AttentionMetadata
from shoal.workers.loader import load_model
from shoal.workers.moe.expert_parallel import EPContext, all_to_all
from tests.fixtures.models import build_checkpoint
from tests.unit.ep_ranks import join_gloo, run_two_ranks

BLOCK_SIZE = 4
# (computed, scheduled) per request, per rank; each rank's split cuts a prefill chunk in two
BATCHES = {
    0: [(9, 1), (0, 12), (5, 1), (6, 4)],  # 18 tokens, split at 9: request 1 spans both halves
    1: [(4, 5), (0, 6), (7, 1), (2, 1)],  # 13 tokens, split at 6: request 1 spans both halves
}
LINK_DELAY_S = 0.05
Forward = Callable[[Any, torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


@dataclass(frozen=True)
class Step:
    """A batch of requests: each one's whole token sequence, and what this step computes."""

    tokens: list[torch.Tensor]  # [computed + scheduled] per request
    computed: list[int]
    scheduled: list[int]

    def block_table(self) -> torch.Tensor:  # [S, max_blocks] int32, consecutive pages
        pages = [-(-len(t) // BLOCK_SIZE) for t in self.tokens]
        table = torch.zeros(len(pages), max(pages), dtype=torch.int32)
        first = 0
        for row, n in enumerate(pages):
            table[row, :n] = torch.arange(first, first + n, dtype=torch.int32)
            first += n
        return table

    def inputs(
        self, rows: list[int], starts: list[int], counts: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Input ids, positions and metadata for ``counts[i]`` tokens of request ``rows[i]``
        from position ``starts[i]``."""
        table = self.block_table()[rows]
        ids = torch.cat(
            [self.tokens[r][s : s + n] for r, s, n in zip(rows, starts, counts, strict=True)]
        )
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts, strict=True)])
        lens = torch.tensor(counts, dtype=torch.int32)
        which = torch.repeat_interleave(torch.arange(len(rows)), lens.long())
        slots = table[which, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
        seq_lens = torch.tensor(
            [s + n for s, n in zip(starts, counts, strict=True)], dtype=torch.int32
        )
        meta = AttentionMetadata(
            slot_mapping=slots,
            block_tables=table,
            query_start_loc=torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0)]).int(),
            seq_lens=seq_lens,
            max_query_len=int(lens.max()),
            max_seq_len=int(seq_lens.max()),
        )
        return ids, positions, meta

    def slices(self) -> list[UBatchSlice]:
        return make_ubatch_slices(self.scheduled, sum(self.scheduled))


def make_step(batch: list[tuple[int, int]], vocab_size: int, seed: int) -> Step:
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(vocab_size, (c + s,), generator=gen) for c, s in batch]
    return Step(tokens, [c for c, _ in batch], [s for _, s in batch])


def run_step(model: Any, step: Step, forward: Forward) -> torch.Tensor:  # [T, hidden]
    """From empty caches: prefill each request's computed tokens (a plain forward), then run
    the step's tokens with ``forward``."""
    cfg = model.config
    num_blocks = int(step.block_table().max()) + 1
    for layer in model.attention_layers():
        shape = (num_blocks, BLOCK_SIZE, layer.num_kv_heads, cfg.head_dim)
        layer.bind_cache(torch.zeros(shape), torch.zeros(shape))
    with torch.inference_mode():
        rows = [r for r, c in enumerate(step.computed) if c]
        model(*step.inputs(rows, [0] * len(rows), [step.computed[r] for r in rows]))
        every = list(range(len(step.tokens)))
        return forward(model, *step.inputs(every, step.computed, step.scheduled))


def plain(model: Any, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata):  # type: ignore[no-untyped-def]
    return model(ids, pos, meta)


def ubatched(step: Step, counts: SplitCounts | None = None) -> Forward:
    def forward(model: Any, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata):  # type: ignore[no-untyped-def]
        return forward_ubatched(model, ids, pos, meta, step.slices(), counts)

    return forward


def close(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, float]:
    scale = want.abs().max().item()
    return torch.allclose(got, want, rtol=1e-5, atol=1e-5 * scale), scale


# ---- one process: no expert parallelism, so no yield ---------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dbo")
    variants = ("mixtral", "qwen2_moe", "qwen3_moe", "qwen3")
    return {v: build_checkpoint(v, root / v, with_tokenizer=False) for v in variants}


@pytest.mark.parametrize("variant", ["qwen3", "mixtral"])
def test_micro_batches_in_turn_equal_the_whole_step(
    checkpoints: dict[str, Path], variant: str
) -> None:
    model, cfg = load_model(checkpoints[variant], dtype=torch.float32, max_positions=64)
    for rank, batch in BATCHES.items():
        step = make_step(batch, cfg.vocab_size, seed=rank)
        want = run_step(model, step, plain)
        counts = SplitCounts()
        got = run_step(model, step, ubatched(step, counts))
        assert got.shape == want.shape == (sum(step.scheduled), cfg.hidden_size)
        assert close(got, want)[0], (variant, rank, (got - want).abs().max().item())
        assert (counts.steps, counts.ubatches) == (1, len(step.slices()))  # it ran split


def test_slices_must_cover_the_step(checkpoints: dict[str, Path]) -> None:
    model, cfg = load_model(checkpoints["qwen3"], dtype=torch.float32, max_positions=64)
    step = make_step(BATCHES[1], cfg.vocab_size, seed=0)
    short = step.slices()[:1]
    with pytest.raises(ValueError, match="do not cover the step's 13 tokens"):
        run_step(model, step, lambda m, i, p, meta: forward_ubatched(m, i, p, meta, short))


# ---- two processes: EP=2, the all-to-alls yield --------------------------------------------


def record_yields(trace: list[int | None]) -> None:
    """Wrap the MoE all-to-all's yield so each call records the micro-batch making it."""
    from shoal.workers.moe import expert_parallel

    real = expert_parallel.dbo_yield

    def recording() -> None:
        trace.append(current_ubatch_id())
        real()

    expert_parallel.dbo_yield = recording  # type: ignore[assignment]


def _rank_main(rank: int, port: int, dirs: dict[str, str], answers: Any) -> None:
    """One EP rank: per family, this rank's step split into micro-batches on the EP=2 model
    vs the plain EP=2 forward and the replicated model; the yields' micro-batch order."""
    try:
        join_gloo(rank, port)
        trace: list[int | None] = []
        record_yields(trace)
        report: dict[str, Any] = {}
        for v, (variant, path) in enumerate(sorted(dirs.items())):
            full, cfg = load_model(path, dtype=torch.float32, max_positions=64)
            ep_model, _ = load_model(
                path, dtype=torch.float32, max_positions=64, ep=EPContext(rank, 2)
            )
            step = make_step(BATCHES[rank], cfg.vocab_size, seed=10 * v + rank)
            want = run_step(full, step, plain)
            plain_ep = run_step(ep_model, step, plain)
            trace.clear()
            got = run_step(ep_model, step, ubatched(step))
            num_moe = sum(hasattr(layer.mlp, "experts") for layer in ep_model.model.layers)
            report[variant] = {
                "vs_replicated": close(got, want),
                "vs_plain_ep": close(got, plain_ep),
                "yields": list(trace),
                "num_moe_layers": num_moe,
            }
        delayed = EPContext(rank, 2, link_delay_s=LINK_DELAY_S)
        start = time.perf_counter()
        received = all_to_all(torch.full((2,), float(rank)), [1, 1], [1, 1], delayed)
        report["delayed"] = (time.perf_counter() - start, received.tolist())
        answers.put((rank, report))
        dist.destroy_process_group()
    except BaseException as exc:  # reported to the test
        answers.put((rank, repr(exc)))


@pytest.mark.timeout(240)
def test_ep2_micro_batches_equal_the_plain_and_replicated_forward(
    checkpoints: dict[str, Path],
) -> None:
    moe = ("mixtral", "qwen2_moe", "qwen3_moe")
    results = run_two_ranks(_rank_main, {k: str(checkpoints[k]) for k in moe})
    for rank in (0, 1):
        report = results[rank]
        assert isinstance(report, dict), f"rank {rank}: {report}"
        elapsed, received = report.pop("delayed")
        assert elapsed >= LINK_DELAY_S and received == [0.0, 1.0]  # injected latency
        assert sorted(report) == sorted(moe)
        for variant, r in report.items():
            assert r["vs_replicated"][0] and r["vs_plain_ep"][0], (rank, variant, r)
            assert r["vs_replicated"][1] > 0.1  # outputs are not trivial
            # three yields per MoE layer (counts, dispatch, combine): outside DBO in the
            # context prefill (no micro-batch), then strictly alternating in the split step
            n = r["num_moe_layers"]
            assert n == (1 if variant == "qwen3_moe" else 2)
            assert r["yields"] == [None] * 3 * n + [0, 1] * 3 * n, (rank, variant)
