"""Small builders for scheduler tests: a scheduler, requests, and a fake worker.

``FakeWorker`` plays a worker's side of the step contract from the ``ExecuteStep`` diffs alone:
it keeps a persistent batch (new requests once, then deltas), writes a fake KV entry
``(position, token id)`` into each slot it computes, checks that every slot a request reads holds
that request's own token at that position (so a wrong prefix-cache hit or a block shared by
mistake shows up), and samples ``token_for(req_id, position)`` when a request reaches its end.
Like the real worker it appends its own sampled tokens to its copy of each request, so a step
sent before the previous one's result is applied (async scheduling) finds its input token.
``Pipeline`` drives a scheduler with several steps in flight.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from shoal.bus.messages.sampling import SamplingParams
from shoal.bus.messages.worker import ExecuteStep, StepResult
from shoal.config.deployment import CacheConfig, SchedulerConfig
from shoal.engine.core.request import Request
from shoal.engine.core.scheduler import Scheduler
from shoal.engine.core.scheduler_output import SchedulerOutput

ROOT = Path(__file__).resolve().parents[2]
_SCHEDULER_FIELDS = set(SchedulerConfig.__struct_fields__)
_CACHE_FIELDS = set(CacheConfig.__struct_fields__)
EOS = 2


def make_scheduler(**overrides: Any) -> Scheduler:
    """A small scheduler; any SchedulerConfig or CacheConfig field, ``num_blocks``,
    ``max_model_len``, ``speculative_config`` or ``grammar_backend``. One step in flight at a
    time unless ``async_scheduling=True``."""
    settings: dict[str, Any] = {
        "async_scheduling": False,
        "max_num_batched_tokens": 64,
        "max_num_seqs": 16,
        "max_model_len": 256,
        "block_size": 4,
        "num_blocks": 65,
    }
    settings.update(overrides)
    num_blocks = settings.pop("num_blocks")
    max_model_len = settings.pop("max_model_len")
    speculative_config = settings.pop("speculative_config", None)
    grammar_backend = settings.pop("grammar_backend", None)
    unknown = set(settings) - _SCHEDULER_FIELDS - _CACHE_FIELDS
    if unknown:
        raise TypeError(f"unknown scheduler settings: {sorted(unknown)}")
    return Scheduler(
        SchedulerConfig(**{k: v for k, v in settings.items() if k in _SCHEDULER_FIELDS}),
        CacheConfig(
            num_gpu_blocks_override=num_blocks,
            **{k: v for k, v in settings.items() if k in _CACHE_FIELDS},
        ),
        max_model_len=max_model_len,
        speculative_config=speculative_config,
        grammar_backend=grammar_backend,
    )


def make_request(
    request_id: str,
    prompt_token_ids: Sequence[int],
    *,
    client_id: str = "client",
    priority: int = 0,
    arrival_time: float = 0.0,
    cache_salt: str | None = None,
    eos_token_ids: Sequence[int] = (EOS,),
    **sampling: Any,
) -> Request:
    sampling.setdefault("max_tokens", 16)
    return Request(
        request_id,
        list(prompt_token_ids),
        SamplingParams(**sampling),
        client_id=client_id,
        arrival_time=arrival_time,
        eos_token_ids=list(eos_token_ids),
        priority=priority,
        cache_salt=cache_salt,
    )


def make_requests(
    num_requests: int,
    prompt_len: int = 10,
    *,
    prefix: Sequence[int] = (),
    start_token: int = 100,
    id_prefix: str = "req",
    **kwargs: Any,
) -> list[Request]:
    """``num_requests`` requests with distinct prompts of ``prompt_len`` after ``prefix``."""
    requests = []
    for index in range(num_requests):
        first = start_token + index * prompt_len
        prompt = list(prefix) + list(range(first, first + prompt_len))
        kwargs.setdefault("arrival_time", 0.0)
        requests.append(
            make_request(f"{id_prefix}{index}", prompt, **{**kwargs, "arrival_time": float(index)})
        )
    return requests


def default_token_for(request_id: str, position: int) -> int:
    """A deterministic 'model': the token at a position depends on the request and position."""
    return 10 + (sum(map(ord, request_id)) * 31 + position * 7) % 50


@dataclasses.dataclass
class _WorkerRequest:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


class FakeWorker:
    def __init__(
        self, block_size: int, token_for: Callable[[str, int], int] = default_token_for
    ) -> None:
        self.block_size = block_size
        self.token_for = token_for
        self.batch: dict[str, _WorkerRequest] = {}
        self.kv: dict[tuple[int, int], tuple[int, int]] = {}  # (block, slot) → (position, token)

    def execute(self, step: ExecuteStep) -> StepResult:
        for req_id in [*step.finished_req_ids, *step.preempted_req_ids]:
            self.batch.pop(req_id, None)
        runs: list[tuple[str, int, int]] = []
        for new in step.new_requests:
            assert new.req_id not in self.batch, f"{new.req_id} sent as new twice"
            assert new.resumed or not new.output_token_ids, new
            self.batch[new.req_id] = _WorkerRequest(
                new.prompt_token_ids + new.output_token_ids,
                list(new.block_ids),
                new.num_computed_tokens,
            )
            runs.append((new.req_id, new.num_computed_tokens, new.num_scheduled_tokens))
        for cached in step.cached_requests:
            state = self.batch[cached.req_id]
            assert cached.num_computed_tokens == state.num_computed_tokens, cached
            state.block_ids.extend(cached.new_block_ids)
            runs.append((cached.req_id, cached.num_computed_tokens, cached.num_scheduled_tokens))
        # Like a real forward pass: the whole step's KV is written before attention reads it.
        for req_id, num_computed, num_scheduled in runs:
            self._write_kv(req_id, num_computed, num_computed + num_scheduled)
        sampled = [self._attend_and_sample(req_id, start + n) for req_id, start, n in runs]
        return StepResult(step.step_id, [run[0] for run in runs], sampled)

    def _slot(self, state: _WorkerRequest, position: int) -> tuple[int, int]:
        return state.block_ids[position // self.block_size], position % self.block_size

    def _write_kv(self, req_id: str, start: int, end: int) -> None:
        state = self.batch[req_id]
        assert end <= len(state.token_ids), (req_id, end, len(state.token_ids))
        assert len(state.block_ids) * self.block_size >= end, (req_id, state.block_ids, end)
        for position in range(start, end):
            self.kv[self._slot(state, position)] = (position, state.token_ids[position])

    def _attend_and_sample(self, req_id: str, end: int) -> list[int]:
        state = self.batch[req_id]
        for position in range(end):  # attention reads every earlier slot
            slot = self._slot(state, position)
            expected = (position, state.token_ids[position])
            assert self.kv.get(slot) == expected, (req_id, position, slot, self.kv.get(slot))
        state.num_computed_tokens = end
        if end < len(state.token_ids):
            return []  # part-way through the prompt
        token = self.token_for(req_id, end)
        state.token_ids.append(token)
        return [token]


def run_to_completion(
    scheduler: Scheduler, worker: FakeWorker, max_steps: int = 1000
) -> dict[str, list[Any]]:
    """Step until no request is left; returns each request's outputs in order."""
    outputs: dict[str, list[Any]] = {}
    for _ in range(max_steps):
        if not scheduler.has_requests():
            return outputs
        step = scheduler.schedule()
        result = worker.execute(step.to_message())
        for client_outputs in scheduler.update_from_output(step, result).values():
            for output in client_outputs:
                outputs.setdefault(output.request_id, []).append(output)
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


class Pipeline:
    """Drives a scheduler with up to ``depth`` steps in flight, as an async engine shell would:
    schedule until ``depth`` steps are outstanding, then let the worker run the oldest (steps
    run in order) and apply its result. ``depth=1`` is today's lock-step loop.

    Records each request's outputs and its total scheduled tokens; ``outstanding`` holds the
    steps in flight with the block ids each of their requests will write.
    """

    def __init__(self, scheduler: Scheduler, worker: FakeWorker, depth: int = 2) -> None:
        self.scheduler = scheduler
        self.worker = worker
        self.depth = depth
        self.outputs: dict[str, list[Any]] = {}
        self.num_scheduled: dict[str, int] = {}
        self.outstanding: list[tuple[SchedulerOutput, dict[str, list[int]]]] = []

    def schedule(self) -> SchedulerOutput | None:
        """One more step in flight (None if it would be empty)."""
        step = self.scheduler.schedule()
        if step.is_empty:
            return None
        written: dict[str, list[int]] = {}
        block_size = self.scheduler.block_size
        for request_id, num_tokens in step.num_scheduled_tokens.items():
            end = step.requests[request_id].num_computed_tokens
            block_ids = self.scheduler.get_block_ids(request_id)
            first, last = (end - num_tokens) // block_size, -(-end // block_size)
            written[request_id] = block_ids[first:last]
            self.num_scheduled[request_id] = self.num_scheduled.get(request_id, 0) + num_tokens
        self.outstanding.append((step, written))
        return step

    def land(self) -> dict[str, list[Any]]:
        """The worker runs the oldest step in flight; its result is applied."""
        step, _ = self.outstanding.pop(0)
        result = self.worker.execute(step.to_message())
        outputs = self.scheduler.update_from_output(step, result)
        self.record(outputs)
        return outputs

    def record(self, outputs: dict[str, list[Any]]) -> None:
        for client_outputs in outputs.values():
            for output in client_outputs:
                self.outputs.setdefault(output.request_id, []).append(output)

    def advance(self) -> None:
        """Fill the pipeline, or land its oldest step when full or nothing more is runnable."""
        if (
            len(self.outstanding) < self.depth
            and self.scheduler.has_requests()
            and self.schedule() is not None
            and len(self.outstanding) < self.depth
        ):
            return
        if not self.outstanding:
            raise AssertionError("nothing runnable and nothing in flight")
        self.land()

    def run(self, max_steps: int = 2000) -> dict[str, list[Any]]:
        for _ in range(max_steps):
            if not self.scheduler.has_requests() and not self.outstanding:
                return self.outputs
            self.advance()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")


def run_in_fresh_python(code: str, hash_seed: str) -> str:
    """Run ``code`` in a new interpreter with ``PYTHONHASHSEED=hash_seed``; its stripped stdout.

    For checking that something (block hashes) does not depend on the process.
    """
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={"PYTHONHASHSEED": hash_seed, "PATH": ""},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
