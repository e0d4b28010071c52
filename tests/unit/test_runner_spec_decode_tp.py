"""Speculative decoding with tensor parallelism on the CPU (two gloo processes): greedy outputs
equal the single-process runner's, and rank 0's emitted tokens are broadcast, so ranks whose
default generators differ still emit the same tokens when sampling at random."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest

from shoal.bus.messages.sampling import SamplingParams
from tests.fixtures.models import build_markov_checkpoint, make_prompts
from tests.golden.driver import greedy, make_runner
from tests.unit.spec_driver import SpecDriver
from tests.unit.test_model_runner_tp import free_port

BLOCK = 4
MAX_TOKENS = 12
TIMEOUT_S = 240
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = make_prompts((5, 9, 17), seed=5)
    params = [greedy(MAX_TOKENS), greedy(MAX_TOKENS),
              SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)]  # fmt: skip
    return prompts, params


def generate(runner, tp_seed: int | None = None):  # type: ignore[no-untyped-def]
    import torch

    if tp_seed is not None:
        torch.manual_seed(tp_seed)  # each rank's default generator differs
    prompts, params = workload()
    return SpecDriver(runner, BLOCK).run(prompts, params, k=3, max_tokens=MAX_TOKENS)


def rank_main(rank: int, port: int, model_dir: str, queue) -> None:  # type: ignore[no-untyped-def]
    import torch

    torch.set_num_threads(1)
    try:
        runner = make_runner(
            model_dir,
            num_blocks=128,
            block_size=BLOCK,
            tp_rank=rank,
            tensor_parallel_size=2,
            tp_init_method=f"tcp://127.0.0.1:{port}",
            speculative_config=NGRAM,
        )
        runner.load()
        run = generate(runner, tp_seed=100 + rank)
        queue.put((rank, run.outputs, run.num_accepted, None))
    except Exception as exc:  # reported to the test, not swallowed
        queue.put((rank, None, 0, repr(exc)))
    finally:
        from shoal.workers.parallel import destroy_tensor_parallel

        destroy_tensor_parallel()


@pytest.mark.slow
def test_tp2_spec_decode_ranks_agree(tmp_path: Path):
    model_dir = build_markov_checkpoint(tmp_path / "m")
    single = make_runner(model_dir, num_blocks=128, block_size=BLOCK, speculative_config=NGRAM)
    single.load()
    expected = generate(single).outputs
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, port, str(model_dir), queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in procs:
            rank, *rest = queue.get(timeout=TIMEOUT_S)
            results[rank] = rest
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank in (0, 1):
        outputs, accepted, error = results[rank]
        assert error is None, f"rank {rank}: {error}"
        assert outputs[:2] == expected[:2] and accepted > 0  # greedy rows
    assert results[0][0] == results[1][0]  # the random row too
