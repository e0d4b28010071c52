"""Drive a ``ModelRunner`` through multi-step generation in tests, two ways: with ``ExecuteStep``
messages built by hand (``generate_by_hand``), and through the engine's real ``Scheduler``
(``generate_with_scheduler``), so prefix-cache hits, chunked prefill and preemption are exercised
exactly as the engine core would send them."""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.bus.messages.engine import SchedulerStats
from shoal.bus.messages.lora import LoRARequest
from shoal.bus.messages.sampling import SamplingParams
from shoal.bus.messages.worker import CachedRequestData, ExecuteStep, NewRequestData, StepResult
from shoal.config.deployment import ShoalConfig
from shoal.engine.core.scheduler import Scheduler
from shoal.engine.core.scheduler_output import SchedulerOutput
from shoal.workers.model_runner import ModelRunner

MAX_STEPS = 2000


def make_runner(
    model_dir: object,
    *,
    num_blocks: int | None = None,
    tp_rank: int = 0,
    tp_init_method: str | None = None,
    **options: object,
) -> ModelRunner:
    """A runner (not loaded) for ``model_dir`` with ``num_blocks`` KV blocks and any other
    config options (``block_size``, ``dtype``, ``max_model_len``, ...). Fault tolerance is off
    unless asked for (its flag or its JSON): with no engine core to send ``JoinGroup``, a
    tensor-parallel runner joins its group at ``tp_init_method`` as a static one."""
    if "fault_tolerance_config" not in options:
        options.setdefault("enable_fault_tolerance", False)
    config = ShoalConfig.from_options(
        model=str(model_dir), num_gpu_blocks_override=num_blocks, **options
    )
    return ModelRunner(config, tp_rank=tp_rank, tp_init_method=tp_init_method)


def greedy(max_tokens: int, **kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)  # type: ignore[arg-type]


def generate_by_hand(
    runner: ModelRunner, prompts: list[list[int]], max_tokens: int, block_size: int
) -> list[list[int]]:
    """Whole prompts in one step, then one decode step per token; blocks handed out in order."""
    next_block = 1
    blocks: list[list[int]] = []
    outputs: list[list[int]] = [[] for _ in prompts]
    new = []
    for i, prompt in enumerate(prompts):
        count = -(-len(prompt) // block_size)
        blocks.append(list(range(next_block, next_block + count)))
        next_block += count
        new.append(
            NewRequestData(
                req_id=f"r{i}",
                prompt_token_ids=prompt,
                sampling_params=greedy(max_tokens),
                block_ids=blocks[i],
                num_computed_tokens=0,
                num_scheduled_tokens=len(prompt),
            )
        )
    result = runner.execute(ExecuteStep(step_id=0, new_requests=new))
    for i, tokens in enumerate(result.sampled_token_ids):
        outputs[i] += tokens
    for step_id in range(1, max_tokens):
        cached = []
        for i, prompt in enumerate(prompts):
            num_computed = len(prompt) + len(outputs[i]) - 1
            new_blocks = []
            if num_computed // block_size >= len(blocks[i]):
                new_blocks = [next_block]
                blocks[i].append(next_block)
                next_block += 1
            cached.append(
                CachedRequestData(
                    req_id=f"r{i}",
                    new_block_ids=new_blocks,
                    num_computed_tokens=num_computed,
                    num_scheduled_tokens=1,
                )
            )
        result = runner.execute(ExecuteStep(step_id=step_id, cached_requests=cached))
        for i, tokens in enumerate(result.sampled_token_ids):
            outputs[i] += tokens
    runner.execute(
        ExecuteStep(step_id=max_tokens, finished_req_ids=[f"r{i}" for i in range(len(prompts))])
    )
    return outputs


@dataclass
class SchedulerRun:
    outputs: dict[str, list[int]]
    num_steps: int = 0
    num_preemptions: int = 0
    prefix_cache_hits: int = 0
    max_scheduled_tokens: int = 0
    partial_prefill_steps: int = 0
    logprobs: dict[str, list] = field(default_factory=dict)
    stats: SchedulerStats | None = None
    spec_k: list[int] = field(default_factory=list)  # drafts to propose, per scheduled step


def generate_with_scheduler(
    runner: ModelRunner,
    prompts: list[list[int]],
    params: list[SamplingParams],
    *,
    num_blocks: int,
    block_size: int,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 64,
    max_model_len: int = 1024,
    enable_prefix_caching: bool = True,
    async_scheduling: bool = False,
    loras: list[LoRARequest | None] | None = None,
) -> SchedulerRun:
    """Run every prompt to completion through ``engine.core.scheduler.Scheduler`` (with the
    runner's speculative config). ``async_scheduling``: each step is scheduled (and run) before
    the previous step's result is applied, as the async engine core does. ``loras``: each
    prompt's adapter (the runner's LoRA config applies)."""
    from shoal.config.deployment import CacheConfig, SchedulerConfig
    from shoal.engine.core.request import Request

    scheduler = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            async_scheduling=async_scheduling,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        speculative_config=runner.config.speculative_config,
        lora_config=runner.config.lora_config,
    )
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        lora = loras[i] if loras is not None else None
        scheduler.add_request(
            Request(
                f"r{i}", list(prompt), p, client_id="c", arrival_time=float(i), lora_request=lora
            )
        )
    run = SchedulerRun(outputs={f"r{i}": [] for i in range(len(prompts))})
    in_flight: list[tuple[SchedulerOutput, StepResult]] = []
    depth = 2 if async_scheduling else 1
    while scheduler.has_requests() or in_flight:
        assert run.num_steps < MAX_STEPS, "generation did not finish"
        if scheduler.has_requests() and len(in_flight) < depth:
            sched_out = scheduler.schedule()
            run.spec_k.append(sched_out.num_spec_tokens_to_propose)
            if not sched_out.is_empty:
                in_flight.append((sched_out, _execute(runner, sched_out, run)))
                if len(in_flight) < depth:
                    continue
        assert in_flight, "requests left that no step schedules"
        _apply(scheduler, *in_flight.pop(0), run)
    run.stats = stats = scheduler.make_stats()
    run.num_preemptions = stats.num_preemptions
    run.prefix_cache_hits = stats.prefix_cache_hits
    return run


def _execute(runner: ModelRunner, sched_out: SchedulerOutput, run: SchedulerRun) -> StepResult:
    step = sched_out.to_message()
    result = runner.execute(step)
    run.num_steps += 1
    run.max_scheduled_tokens = max(
        run.max_scheduled_tokens,
        sum(r.num_scheduled_tokens for r in step.new_requests + step.cached_requests),
    )
    run.partial_prefill_steps += sum(1 for t in result.sampled_token_ids if not t)
    return result


def _apply(
    scheduler: Scheduler, sched_out: SchedulerOutput, result: StepResult, run: SchedulerRun
) -> None:
    for outs in scheduler.update_from_output(sched_out, result).values():
        for out in outs:
            assert out.error is None, out.error
            run.outputs[out.request_id] += out.new_token_ids
            if out.new_logprobs is not None:
                run.logprobs.setdefault(out.request_id, []).append(out.new_logprobs)
