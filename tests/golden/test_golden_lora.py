"""Multi-LoRA greedy outputs against transformers with PEFT's adapter applied, token for token:
a mixed batch of several adapters and the base model through the real scheduler, on Llama and
Qwen2 (q/k/v biases), with more adapters than worker slots (slots written and evicted), and with
tensor parallelism (two gloo ranks). Each adapter changes the outputs (checked), so a LoRA path
that added nothing could not pass."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest

from shoal.bus.messages.lora import LoRARequest
from tests.fixtures.lora import build_adapter, hf_lora_greedy
from tests.fixtures.models import build_checkpoint, build_markov_checkpoint, make_prompts
from tests.golden.driver import generate_with_scheduler, greedy, make_runner
from tests.unit.test_model_runner_tp import free_port

BLOCK = 4
MAX_TOKENS = 8
NUM_BLOCKS = 256
TIMEOUT_S = 240
PROMPTS = make_prompts((5, 17, 9, 33, 3, 12, 21), seed=3)
WHICH = [0, 1, None, 2, 0, None, 1]  # each prompt's adapter (None: the base model)


def adapters_of(model_dir: Path, out: Path) -> list[Path]:
    """Three adapters: rank 8, rank 16 (the slot width) and rank 4 on attention only, rsLoRA."""
    return [
        build_adapter(model_dir, out / "a0", seed=10, rank=8),
        build_adapter(model_dir, out / "a1", seed=11, rank=16, alpha=32.0),
        build_adapter(
            model_dir, out / "a2", seed=12, rank=4, use_rslora=True,
            targets=("q_proj", "k_proj", "v_proj", "o_proj"),
        ),
    ]  # fmt: skip


def requests_of(adapters: list[Path]) -> list[LoRARequest | None]:
    return [None if w is None else LoRARequest(f"a{w}", w + 1, str(adapters[w])) for w in WHICH]


def expected_outputs(
    model_dir: Path, adapters: list[Path], max_tokens: int = MAX_TOKENS
) -> list[list[int]]:
    return [
        hf_lora_greedy(model_dir, None if w is None else adapters[w], [p], max_tokens)[0]
        for p, w in zip(PROMPTS, WHICH, strict=True)
    ]


def run(runner, adapters: list[Path], max_tokens: int = MAX_TOKENS):  # type: ignore[no-untyped-def]
    """Each prompt's greedy output through the scheduler, and the scheduler's stats."""
    run = generate_with_scheduler(
        runner,
        PROMPTS,
        [greedy(max_tokens)] * len(PROMPTS),
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK,
        loras=requests_of(adapters),
    )
    return [run.outputs[f"r{i}"] for i in range(len(PROMPTS))], run.stats


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_mixed_batch_of_adapters_equals_peft(tmp_path: Path, variant: str):
    model_dir = build_checkpoint(variant, tmp_path / "m")
    adapters = adapters_of(model_dir, tmp_path)
    expected = expected_outputs(model_dir, adapters)
    base = hf_lora_greedy(model_dir, None, PROMPTS, MAX_TOKENS)
    with_adapter = [i for i, w in enumerate(WHICH) if w is not None]
    assert all(expected[i] != base[i] for i in with_adapter), "an adapter changed nothing"

    # two slots for three adapters: the scheduler holds an adapter back until one is free,
    # and the worker evicts the least recently used slot
    runner = make_runner(
        model_dir, num_blocks=NUM_BLOCKS, block_size=BLOCK, dtype="float32",
        enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2,
    )  # fmt: skip
    runner.load()
    assert run(runner, adapters)[0] == expected
    lora = runner.lora
    assert lora is not None
    assert lora.num_slot_writes >= 3 and lora.slots.num_evictions >= 1
    assert lora.num_reads >= 3  # two host slots: an adapter was read again


def rank_main(rank: int, port: int, model_dir: str, adapters: list[str], queue) -> None:  # type: ignore[no-untyped-def]
    import torch

    torch.set_num_threads(1)
    try:
        runner = make_runner(
            model_dir, num_blocks=NUM_BLOCKS, block_size=BLOCK, dtype="float32",
            tp_rank=rank, tensor_parallel_size=2, tp_init_method=f"tcp://127.0.0.1:{port}",
            enable_lora=True, max_loras=3, max_lora_rank=16,
        )  # fmt: skip
        runner.load()
        queue.put((rank, run(runner, [Path(a) for a in adapters])[0], None))
    except Exception as exc:  # reported to the test, not swallowed
        queue.put((rank, None, repr(exc)))
    finally:
        from shoal.workers.parallel import destroy_tensor_parallel

        destroy_tensor_parallel()


@pytest.mark.slow
def test_tp2_mixed_batch_equals_peft(tmp_path: Path):
    """Each rank holds A whole and its rows of B (q/k/v, gate/up), or its input columns of A
    (o, down) with the partial product added before the all-reduce."""
    model_dir = build_checkpoint("qwen2", tmp_path / "m")
    adapters = adapters_of(model_dir, tmp_path)
    expected = expected_outputs(model_dir, adapters)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    args = (port, str(model_dir), [str(a) for a in adapters], queue)
    procs = [ctx.Process(target=rank_main, args=(r, *args)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in procs:
            rank, outputs, error = queue.get(timeout=TIMEOUT_S)
            results[rank] = (outputs, error)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank in (0, 1):
        outputs, error = results[rank]
        assert error is None, f"rank {rank}: {error}"
        assert outputs == expected, f"rank {rank}"


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


@pytest.mark.slow
def test_ngram_drafts_verified_with_each_requests_adapter(tmp_path: Path):
    """A Markov model (attention and MLP write nothing: greedy outputs loop, drafts get
    accepted) with adapters on its MLP only (a function of the current token: still Markov,
    but a different chain per adapter): with n-gram speculation, outputs equal PEFT's and drafts
    are accepted."""
    model_dir = build_markov_checkpoint(tmp_path / "m")
    mlp = ("gate_proj", "up_proj", "down_proj")
    adapters = [
        build_adapter(model_dir, tmp_path / f"a{i}", seed=30 + i, rank=8, alpha=64.0, targets=mlp)
        for i in range(3)
    ]
    expected = expected_outputs(model_dir, adapters, max_tokens=24)
    base = hf_lora_greedy(model_dir, None, PROMPTS, 24)
    assert sum(expected[i] != base[i] for i, w in enumerate(WHICH) if w is not None) >= 3
    runner = make_runner(
        model_dir, num_blocks=NUM_BLOCKS, block_size=BLOCK, dtype="float32",
        enable_lora=True, max_loras=3, max_lora_rank=16, speculative_config=NGRAM,
    )  # fmt: skip
    runner.load()
    outputs, stats = run(runner, adapters, max_tokens=24)
    assert outputs == expected
    assert stats.spec_decode_num_accepted_tokens >= 20
