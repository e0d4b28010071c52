"""Plays the engine core's part for a ``ModelRunner`` with speculative decoding, by hand: after
each result it rolls back the rejected drafts, schedules ``1 + drafts`` tokens with
``num_spec_tokens`` for each request, and hands out enough KV blocks.

``optimistic``: send the engine core's ``num_computed_tokens`` as async scheduling would (ahead
by the previous step's rejections, which it does not know of yet). ``extra_drafts``: schedule
that many drafts beyond those the worker proposed (as an engine core scheduling drafts it has
not seen yet); the worker pads them with -1."""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.bus.messages.engine import Logprobs
from shoal.bus.messages.sampling import SamplingParams
from shoal.bus.messages.worker import CachedRequestData, ExecuteStep, NewRequestData
from shoal.workers.model_runner import ModelRunner

MAX_STEPS = 200


@dataclass
class _Req:
    req_id: str
    prompt: list[int]
    blocks: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, float]] = field(default_factory=list)  # (token, its logprob)
    computed: int = 0  # the engine core's true count
    scheduled: int = 0
    verifying: int = 0  # drafts scheduled this step
    lag: int = 0  # rejections of the last step
    drafts: list[int] = field(default_factory=list)


@dataclass
class SpecRun:
    outputs: list[list[int]]
    logprobs: list[list[tuple[int, float]]]
    num_steps: int = 0
    num_drafts: int = 0  # verified
    num_accepted: int = 0


class SpecDriver:
    def __init__(self, runner: ModelRunner, block_size: int) -> None:
        self.runner = runner
        self.block_size = block_size
        self.next_block = 1

    def _grow(self, req: _Req, num_tokens: int) -> list[int]:
        new = []
        while (len(req.blocks) + len(new)) * self.block_size < num_tokens:
            new.append(self.next_block)
            self.next_block += 1
        req.blocks += new
        return new

    def run(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        *,
        k: int,
        max_tokens: int,
        optimistic: bool = False,
        extra_drafts: int = 0,
        first_chunk: int | None = None,
    ) -> SpecRun:
        """Every prompt to ``max_tokens`` outputs (at most ``first_chunk`` prompt tokens in the
        first step), verifying drafts and proposing ``k`` per step."""
        reqs = [_Req(f"r{i}", p) for i, p in enumerate(prompts)]
        new = []
        for req, sp in zip(reqs, params, strict=True):
            req.scheduled = min(len(req.prompt), first_chunk or len(req.prompt))
            new.append(
                NewRequestData(
                    req.req_id, req.prompt, sp, self._grow(req, req.scheduled), 0, req.scheduled
                )
            )
        step = ExecuteStep(step_id=0, new_requests=new, num_spec_tokens=k)
        run = SpecRun([], [])
        for step_id in range(1, MAX_STEPS):
            result = self.runner.execute(step)
            assert result.error is None and result.req_ids == [r.req_id for r in reqs]
            self._absorb(run, reqs, result.sampled_token_ids, result.logprobs,
                         result.spec_token_ids)  # fmt: skip
            run.num_steps += 1
            if all(len(r.outputs) >= max_tokens for r in reqs):
                break
            cached = [self._schedule(r, optimistic, extra_drafts) for r in reqs]
            step = ExecuteStep(step_id=step_id, cached_requests=cached, num_spec_tokens=k)
        else:
            raise AssertionError("requests did not finish")
        self.runner.execute(
            ExecuteStep(step_id=MAX_STEPS, finished_req_ids=[r.req_id for r in reqs])
        )
        run.outputs = [r.outputs[:max_tokens] for r in reqs]
        run.logprobs = [r.logprobs[:max_tokens] for r in reqs]
        return run

    def _absorb(
        self,
        run: SpecRun,
        reqs: list[_Req],
        sampled: list[list[int]],
        logprobs: list[Logprobs | None],
        spec_ids: list[list[int]],
    ) -> None:
        for i, (req, tokens) in enumerate(zip(reqs, sampled, strict=True)):
            req.drafts = spec_ids[i] if spec_ids else []
            if not tokens:  # part-way through its prompt: proposes nothing
                assert req.drafts == [] and req.verifying == 0
                req.computed += req.scheduled
                continue
            assert 1 <= len(tokens) <= req.verifying + 1
            req.lag = req.verifying + 1 - len(tokens)
            req.computed += req.scheduled - req.lag
            req.outputs += tokens
            run.num_drafts += req.verifying
            run.num_accepted += len(tokens) - 1
            lp = logprobs[i] if logprobs else None
            if lp is not None:
                assert [row[0] for row in lp.token_ids] == tokens  # a row per emitted token
                pairs = zip(lp.token_ids, lp.logprobs, strict=True)
                req.logprobs += [(row[0], values[0]) for row, values in pairs]

    def _schedule(self, req: _Req, optimistic: bool, extra: int) -> CachedRequestData:
        left = len(req.prompt) - req.computed
        if left > 0:  # the rest of the prompt
            req.scheduled, req.verifying = left, 0
        else:
            req.verifying = len(req.drafts) + extra
            req.scheduled = 1 + req.verifying
        sent = req.computed + (req.lag if optimistic else 0)
        blocks = self._grow(req, sent + req.scheduled)
        return CachedRequestData(req.req_id, blocks, sent, req.scheduled, req.verifying)
