"""Decode steps through ``workers.cuda_graphs`` (static buffers, padded batch sizes) give
transformers' greedy tokens. On the CPU the "capture" replays by calling the forward again over
the static buffers, so everything but the CUDA capture itself is checked here (the real capture:
``bench/gpu_check.py`` on a GPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shoal.workers.cuda_graphs import default_capture_sizes
from tests.fixtures.models import make_prompts
from tests.golden.driver import generate_with_scheduler, greedy, make_runner

BLOCK = 4


def replay_by_calling(forward: Any, pool: Any) -> Any:
    """A stand-in capture: each replay runs the forward on the static buffers."""
    return forward


def test_default_capture_sizes_cover_every_decode_batch():
    assert default_capture_sizes(3) == [1, 2, 3]
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = default_capture_sizes(1024)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 512 and len(sizes) == 3 + 64


def _generate(runner, prompts, max_tokens):  # type: ignore[no-untyped-def]
    runner.load()
    run = generate_with_scheduler(
        runner,
        prompts,
        [greedy(n) for n in max_tokens],
        num_blocks=128,
        block_size=BLOCK,
        max_num_batched_tokens=256,
    )
    return [run.outputs[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("variant", ["llama", "qwen2_moe"])
def test_decode_graphs_match_transformers(variant, tiny_checkpoint, hf_reference):
    """Requests of different lengths finish at different steps, so the decode batch shrinks
    through padded sizes (3 live rows in the graph of 4, the fourth row stale from a live
    request's previous step); prefill steps run eagerly. Every decode step went through a
    graph, the tokens are transformers', and the KV cache is the eager run's (the padding rows
    wrote nothing; the MoE's expert matmuls round a little differently by batch)."""
    model_dir = tiny_checkpoint(variant)
    prompts = make_prompts()[:5]
    max_tokens = [3, 12, 7, 12, 9]
    graphed = make_runner(model_dir, num_blocks=128, block_size=BLOCK, cuda_graph_sizes=[2, 4, 8])
    graphed.graph_capture = replay_by_calling
    ours = _generate(graphed, prompts, max_tokens)
    assert graphed.graphs is not None and graphed.graphs.sizes == [2, 4, 8]
    expected = hf_reference(model_dir, prompts, max(max_tokens))
    assert ours == [e[:n] for e, n in zip(expected, max_tokens, strict=True)]
    assert graphed.graphs.num_replays == max(max_tokens) - 1  # every decode step
    eager = make_runner(model_dir, num_blocks=128, block_size=BLOCK)
    assert _generate(eager, prompts, max_tokens) == ours
    for mine, theirs in zip(
        graphed.kv_cache.k + graphed.kv_cache.v, eager.kv_cache.k + eager.kv_cache.v, strict=True
    ):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)  # MoE: rounding by batch


def test_enforce_eager_and_no_capture_keep_graphs_off(tiny_checkpoint):
    model_dir = tiny_checkpoint("llama")
    eager = make_runner(model_dir, num_blocks=32, block_size=BLOCK, enforce_eager=True)
    eager.graph_capture = replay_by_calling
    eager.load()
    cpu = make_runner(model_dir, num_blocks=32, block_size=BLOCK)
    cpu.load()
    assert eager.graphs is None and cpu.graphs is None
