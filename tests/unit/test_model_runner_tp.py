"""Tensor parallelism on the CPU: two worker processes (gloo) each hold half of every attention
and MLP layer; their greedy tokens equal transformers' and the single-process runner's."""

from __future__ import annotations

import multiprocessing as mp
import socket
from pathlib import Path

import pytest

from tests.fixtures.models import make_prompts
from tests.golden.driver import generate_by_hand, make_runner

BLOCK = 4
MAX_NEW = 8
TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tp_rank_main(rank: int, size: int, port: int, model_dir: str, queue) -> None:  # type: ignore[no-untyped-def]
    import torch

    torch.set_num_threads(1)
    try:
        runner = make_runner(
            model_dir,
            num_blocks=64,
            block_size=BLOCK,
            tp_rank=rank,
            tensor_parallel_size=size,
            tp_init_method=f"tcp://127.0.0.1:{port}",
        )
        facts = runner.load()
        shapes = {
            "qkv": tuple(runner.model.model.layers[0].self_attn.qkv_proj.weight.shape),
            "down": tuple(runner.model.model.layers[0].mlp.down_proj.weight.shape),
            "kv_cache": tuple(runner.kv_cache.k[0].shape),
            "linear_weights": facts.linear_weights,
        }
        outputs = generate_by_hand(runner, make_prompts(), MAX_NEW, BLOCK)
        queue.put((rank, outputs, shapes, facts.num_blocks, None))
    except Exception as exc:  # reported to the test, not swallowed
        queue.put((rank, None, None, None, repr(exc)))
    finally:
        from shoal.workers.parallel import destroy_tensor_parallel

        destroy_tensor_parallel()


def run_tp(model_dir: Path, size: int = 2) -> dict[int, tuple]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=tp_rank_main, args=(r, size, port, str(model_dir), queue))
        for r in range(size)
    ]
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in range(size):
            rank, *rest = queue.get(timeout=TIMEOUT_S)
            results[rank] = tuple(rest)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return results


@pytest.mark.slow
@pytest.mark.parametrize(("variant", "kv_heads"), [("llama", 2), ("qwen2", 1)])
def test_tp2_matches_single_process_and_transformers(variant, kv_heads, tmp_path, hf_reference):
    from tests.fixtures.models import build_checkpoint

    model_dir = build_checkpoint(
        variant, tmp_path / "m", num_key_value_heads=kv_heads, with_tokenizer=False
    )
    prompts = make_prompts()
    single = make_runner(model_dir, num_blocks=64, block_size=BLOCK)
    single.load()
    expected = generate_by_hand(single, prompts, MAX_NEW, BLOCK)
    assert expected == hf_reference(model_dir, prompts, MAX_NEW)
    results = run_tp(model_dir)
    for rank in (0, 1):
        outputs, shapes, num_blocks, error = results[rank]
        assert error is None, f"rank {rank}: {error}"
        assert outputs == expected
        assert num_blocks == 64
        # each rank holds half the q heads (16-dim heads) and half the MLP input features
        q_rows = 2 * 16
        kv_rows = 16  # one KV head per rank: split (2 heads) or replicated (1 head)
        assert shapes["qkv"] == (q_rows + 2 * kv_rows, 64)
        assert shapes["down"] == (64, 64)
        assert shapes["kv_cache"] == (64, BLOCK, 1, 16)
