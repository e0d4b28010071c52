"""Scheduler + KV cache manager cost per step, driven by a fake model (not a test).

Workload (issue 3): 1,024 prompts of 64–1,024 random tokens, 30% of them behind a common
512-token prefix, built from ``random.Random(0)`` so they are identical on any machine; 128 output
tokens each (eos ignored); block size 16, 20,000 blocks, max_num_batched_tokens 8,192, chunked
prefill on; max_num_seqs 256 and 64, prefix caching on and off. All requests arrive at once.

The fake model answers each step with one token per scheduled request that reached the end of
its known tokens (none for a request part-way through its prompt). Timed per step:
``schedule()`` + ``to_message()`` + ``update_from_output()``; the fake model is not timed. Each
case runs ``--repeats`` (3) times from scratch; the scheduler is deterministic (the runs are
checked to take the same steps), so each step's time is its fastest over the runs: a step the
host interrupted in one run (on a shared virtual machine, a few per run) does not set the tail.

Garbage collection as in the engine: the scheduler is built, then ``gc.freeze()`` (an actor
process freezes its start-up heap once started), then the requests are added. Frozen or not, the
timed steps see at most a few young-generation collections (~0.1 ms): allocations balance.

The tail (p99) comes from the steps that finish one wave of requests and admit the next: they
schedule up to 8,192 prefill tokens and take and free hundreds of blocks, where a decode step
schedules one token per running request. So the figures are also given per kind of step:
``decode_*`` for steps that only decode (no request admitted or finished), ``wave_*`` for the
others; the decode steps' own p99 shows what is left of the tail once the work is alike.
Each case runs on the block pool's C arrays (where ``setup.py`` built them) and on its Python
arrays, one after the other (``--block-arrays``): the wave steps' block work is what the C
arrays take out.

    .venv/bin/python bench/scheduler.py [--cases 256:on,64:on] [--repeats 3]
        [--block-arrays native,python]

The last line printed is one JSON object: ``{"cases": [{"block_arrays", "max_num_seqs",
"prefix_caching", "steps", "us_per_step_mean", "us_per_step_p50", "us_per_step_p99",
"p99_over_p50", "tokens_per_s"}, ...]}`` (plus ``total_s``, CPU-time figures and the
prefix-cache hit rate). Wall-clock figures on a
shared machine are noisy; the CPU-time figures count only this process's own time (on a virtual
machine they still include time the host took the CPU away, hence the CPU p99 too).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shoal.bus.messages.sampling import SamplingParams
from shoal.bus.messages.worker import ExecuteStep, StepResult
from shoal.config.deployment import CacheConfig, SchedulerConfig
from shoal.engine.core.block_pool_arrays import BLOCK_ARRAYS_ENV, native_block_arrays_available
from shoal.engine.core.request import Request
from shoal.engine.core.scheduler import Scheduler

NUM_OUTPUT_TOKENS = 128


def build_prompts() -> list[list[int]]:
    rng = random.Random(0)
    common = [rng.randrange(3, 32000) for _ in range(512)]
    prompts = []
    for _ in range(1024):
        body = [rng.randrange(3, 32000) for _ in range(rng.randint(64, 1024))]
        if rng.random() < 0.3:
            body = common + body
        prompts.append(body)
    return prompts


class FakeModel:
    """Keeps each request's token count from the step diffs; samples a token at the end."""

    def __init__(self) -> None:
        self.num_tokens: dict[str, int] = {}

    def execute(self, step: ExecuteStep) -> StepResult:
        num_tokens = self.num_tokens
        for req_id in step.finished_req_ids:
            num_tokens.pop(req_id, None)
        for req_id in step.preempted_req_ids:
            num_tokens.pop(req_id, None)
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        for new in step.new_requests:
            num_tokens[new.req_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
            self._run(
                new.req_id, new.num_computed_tokens + new.num_scheduled_tokens, req_ids, sampled
            )
        for cached in step.cached_requests:
            self._run(
                cached.req_id,
                cached.num_computed_tokens + cached.num_scheduled_tokens,
                req_ids,
                sampled,
            )
        return StepResult(step.step_id, req_ids, sampled)

    def _run(
        self, req_id: str, num_done: int, req_ids: list[str], sampled: list[list[int]]
    ) -> None:
        req_ids.append(req_id)
        if num_done >= self.num_tokens[req_id]:
            self.num_tokens[req_id] += 1
            sampled.append([7 + num_done % 1000])
        else:
            sampled.append([])


class TimedRun(NamedTuple):
    """One run's per-step wall and CPU times, which steps were waves, and the totals."""

    step_times: list[float]
    cpu_times: list[float]
    is_wave: list[bool]
    num_tokens_scheduled: int
    prefix_cache_hit_rate: float


def timed_run(prompts: list[list[int]], max_num_seqs: int, prefix_caching: bool) -> TimedRun:
    """Every request through a fresh scheduler, each step timed."""
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=8192, max_num_seqs=max_num_seqs, enable_chunked_prefill=True
        ),
        CacheConfig(
            block_size=16, enable_prefix_caching=prefix_caching, num_gpu_blocks_override=20000
        ),
        max_model_len=4096,
    )
    gc.collect()
    gc.freeze()  # as the engine core actor does once its core is built
    params = SamplingParams(max_tokens=NUM_OUTPUT_TOKENS, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        scheduler.add_request(
            Request(f"r{index}", prompt, params, client_id="bench", eos_token_ids=[2])
        )
    model = FakeModel()
    step_times: list[float] = []
    cpu_times: list[float] = []  # CPU time of this process: robust to a busy shared machine
    is_wave: list[bool] = []  # a request admitted or finished in the step
    num_tokens_scheduled = 0
    gc.collect()
    while scheduler.has_requests():
        start, cpu_start = time.perf_counter(), time.process_time()
        output = scheduler.schedule()
        message = output.to_message()
        scheduled, cpu_scheduled = time.perf_counter(), time.process_time()
        result = model.execute(message)
        resumed, cpu_resumed = time.perf_counter(), time.process_time()
        scheduler.update_from_output(output, result)
        done, cpu_done = time.perf_counter(), time.process_time()
        step_times.append((scheduled - start) + (done - resumed))
        cpu_times.append((cpu_scheduled - cpu_start) + (cpu_done - cpu_resumed))
        is_wave.append(bool(output.new_requests or output.finished_req_ids))
        num_tokens_scheduled += output.total_num_scheduled_tokens
    gc.unfreeze()  # the next run freezes its own start-up heap
    kv = scheduler.kv_cache_manager
    hit_rate = kv.prefix_cache_hits / max(kv.prefix_cache_queries, 1)
    return TimedRun(step_times, cpu_times, is_wave, num_tokens_scheduled, hit_rate)


def fastest_per_step(runs: list[TimedRun]) -> TimedRun:
    """Each step's fastest time over identical runs (the scheduler is deterministic: every run
    takes the same steps), so a step the host interrupted in one run does not set the tail."""
    first = runs[0]
    for run in runs[1:]:
        if run.is_wave != first.is_wave:
            raise RuntimeError("the runs took different steps: the scheduler is not deterministic")
    return first._replace(
        step_times=[min(times) for times in zip(*(run.step_times for run in runs), strict=True)],
        cpu_times=[min(times) for times in zip(*(run.cpu_times for run in runs), strict=True)],
    )


def run_case(
    prompts: list[list[int]], max_num_seqs: int, prefix_caching: bool, repeats: int
) -> dict[str, object]:
    run = fastest_per_step(
        [timed_run(prompts, max_num_seqs, prefix_caching) for _ in range(repeats)]
    )
    step_times, cpu_times = run.step_times, run.cpu_times
    total_s = sum(step_times)
    micros = sorted(t * 1e6 for t in step_times)
    cpu_micros = sorted(t * 1e6 for t in cpu_times)
    p99_index = min(len(micros) - 1, int(len(micros) * 0.99))
    return {
        "max_num_seqs": max_num_seqs,
        "prefix_caching": prefix_caching,
        "repeats": repeats,
        "steps": len(step_times),
        "total_s": round(total_s, 4),
        "us_per_step_mean": round(statistics.fmean(micros), 1),
        "us_per_step_p50": round(statistics.median(micros), 1),
        "us_per_step_p99": round(micros[p99_index], 1),
        "p99_over_p50": round(micros[p99_index] / statistics.median(micros), 2),
        "tokens_per_s": round(run.num_tokens_scheduled / total_s, 1),
        "cpu_us_per_step_mean": round(statistics.fmean(cpu_times) * 1e6, 1),
        "cpu_us_per_step_p50": round(statistics.median(cpu_micros), 1),
        "cpu_us_per_step_p99": round(cpu_micros[p99_index], 1),
        **_by_kind(step_times, run.is_wave),
        "prefix_cache_hit_rate": round(run.prefix_cache_hit_rate, 4),
    }


def _by_kind(step_times: list[float], is_wave: list[bool]) -> dict[str, float]:
    """p50/p99 of the decode-only steps, p50 of the wave steps, and how many of each."""
    decode = sorted(t * 1e6 for t, wave in zip(step_times, is_wave, strict=True) if not wave)
    waves = sorted(t * 1e6 for t, wave in zip(step_times, is_wave, strict=True) if wave)
    return {
        "decode_steps": len(decode),
        "decode_us_p50": round(statistics.median(decode), 1) if decode else 0.0,
        "decode_us_p99": round(decode[min(len(decode) - 1, int(len(decode) * 0.99))], 1)
        if decode
        else 0.0,
        "wave_steps": len(waves),
        "wave_us_p50": round(statistics.median(waves), 1) if waves else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--cases",
        default="256:on,256:off,64:on,64:off",
        help="comma-separated max_num_seqs:on|off (prefix caching)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="identical runs per case; each step's time is its fastest (1: a single run)",
    )
    parser.add_argument(
        "--block-arrays",
        default="native,python" if native_block_arrays_available() else "python",
        help="the block pool's arrays to run each case on, side by side: native (C, built by "
        "setup.py) and/or python",
    )
    args = parser.parse_args()
    prompts = build_prompts()
    cases = []
    for spec in args.cases.split(","):
        seqs, caching = spec.split(":")
        for arrays in args.block_arrays.split(","):
            os.environ[BLOCK_ARRAYS_ENV] = arrays  # read where the scheduler builds its pool
            case = {"block_arrays": arrays} | run_case(
                prompts, int(seqs), caching == "on", args.repeats
            )
            print_case(case, caching)
            cases.append(case)
    print(json.dumps({"cases": cases}))


def print_case(case: dict[str, Any], caching: str) -> None:
    print(
        f"max_num_seqs={case['max_num_seqs']:>3} prefix_caching={caching:<3} "
        f"arrays={case['block_arrays']:<6} p99/p50={case['p99_over_p50']} "
        f"steps={case['steps']} total={case['total_s']}s "
        f"us/step mean={case['us_per_step_mean']} p50={case['us_per_step_p50']} "
        f"p99={case['us_per_step_p99']} tokens/s={case['tokens_per_s']} "
        f"cpu_us/step mean={case['cpu_us_per_step_mean']} p50={case['cpu_us_per_step_p50']} "
        f"p99={case['cpu_us_per_step_p99']} "
        f"decode-only({case['decode_steps']}) p50={case['decode_us_p50']} "
        f"p99={case['decode_us_p99']} wave({case['wave_steps']}) p50={case['wave_us_p50']} "
        f"hit_rate={case['prefix_cache_hit_rate']}",
        flush=True,
    )


if __name__ == "__main__":
    main()
