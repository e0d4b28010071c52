"""CUDA graphs for decode steps: the model forward captured once per batch size at load, over
static input buffers, and replayed for every step whose queries are all one token (vLLM's full
graphs for uniform decode batches). A decode step of a small model on a GPU is launch-bound (a
few hundred kernels of microseconds each); a replay launches them all at once.

A step of ``n`` decodes replays the graph of the smallest captured size ``>= n``; the padding
rows write no KV (slot -1), attend to one key of whatever block their table row holds, and their
outputs are dropped. The decode attention kernel is captured for ``max_model_len`` keys (its
grid cannot follow the step's longest sequence); each sequence still reads only its own keys.
Steps with longer queries (prefill chunks, drafts being verified) or more decodes than the
largest size run eagerly.

``GraphCapture`` turns a forward into a replay; ``capture_cuda_graph`` is the real one. Tests on
the CPU pass one that replays by calling the forward again, which checks everything here but
the capture itself (``bench/gpu_check.py`` runs the real one on a GPU).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from shoal.workers.input_batch import StepInputs
from shoal.workers.layers.attention import AttentionMetadata

log = logging.getLogger(__name__)

MAX_DEFAULT_SIZE = 512
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
Replay = Callable[[], torch.Tensor]
GraphCapture = Callable[[Callable[[], torch.Tensor], Any], Replay]


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's default sizes: 1, 2, 4, then every multiple of 8, up to ``max_num_seqs`` (at
    most 512), and ``max_num_seqs`` itself so every decode step fits."""
    limit = min(max_num_seqs, MAX_DEFAULT_SIZE)
    sizes = [n for n in (1, 2, 4) if n <= limit] + list(range(8, limit + 1, 8))
    return sorted({*sizes, limit})


def capture_cuda_graph(forward: Callable[[], torch.Tensor], pool: Any) -> Replay:
    """Run ``forward`` once (Triton compiles, the allocator warms), then capture it into a CUDA
    graph sharing ``pool``; the replay returns the captured output tensor."""
    forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


class DecodeGraphs:
    """The static buffers and one replay per captured batch size."""

    def __init__(
        self,
        forward: Forward,
        *,
        sizes: list[int],
        max_blocks_per_seq: int,
        max_model_len: int,
        device: torch.device,
        capture: GraphCapture = capture_cuda_graph,
    ) -> None:
        self.forward = forward
        self.sizes = sorted(set(sizes))
        self.max_size = self.sizes[-1]
        self.max_model_len = max_model_len
        self.device = device
        self._capture = capture
        self._replays: dict[int, Replay] = {}
        self.num_replays = 0  # steps run through a graph
        size = self.max_size
        with torch.inference_mode():
            self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
            self.positions = torch.zeros(size, dtype=torch.int64, device=device)
            self.slot_mapping = torch.full((size,), -1, dtype=torch.int64, device=device)
            self.block_tables = torch.zeros(
                size, max_blocks_per_seq, dtype=torch.int32, device=device
            )
            self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
            self.seq_lens = torch.ones(size, dtype=torch.int32, device=device)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every size, largest first (the smaller ones reuse its memory)."""
        pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        for size in reversed(self.sizes):
            self._replays[size] = self._capture(self._forward_of(size), pool)

    def _forward_of(self, size: int) -> Callable[[], torch.Tensor]:
        def forward() -> torch.Tensor:
            meta = AttentionMetadata(
                slot_mapping=self.slot_mapping[:size],
                block_tables=self.block_tables[:size],
                query_start_loc=self.query_start_loc[: size + 1],
                seq_lens=self.seq_lens[:size],
                max_query_len=1,
                max_seq_len=self.max_model_len,
            )
            return self.forward(self.input_ids[:size], self.positions[:size], meta)

        return forward

    def fits(self, inputs: StepInputs) -> bool:
        """Whether the step is all single-token queries within the largest captured size."""
        num_tokens = len(inputs.input_ids)
        return (
            bool(self._replays)
            and inputs.max_query_len == 1
            and num_tokens == len(inputs.req_ids)
            and num_tokens <= self.max_size
        )

    def run(self, inputs: StepInputs) -> torch.Tensor:  # [n, hidden]
        """The step's hidden states through the smallest graph that holds it (``fits``)."""
        n = len(inputs.input_ids)
        size = next(s for s in self.sizes if s >= n)
        self._fill(inputs, n, size)
        self.num_replays += 1
        return self._replays[size]()[:n]

    def _fill(self, inputs: StepInputs, n: int, size: int) -> None:
        def put(buffer: torch.Tensor, values: np.ndarray) -> None:
            buffer[:n].copy_(torch.from_numpy(values), non_blocking=True)

        put(self.input_ids, inputs.input_ids)
        put(self.positions, inputs.positions)
        put(self.slot_mapping, inputs.slot_mapping)
        put(self.seq_lens, inputs.seq_lens)
        width = inputs.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(
            torch.from_numpy(inputs.block_tables), non_blocking=True
        )
        if size > n:  # padding rows: no KV written, one key read
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
