"""A fake worker that plays the speculative-decoding side of the step contract
(``bus.messages.worker``): it proposes drafts after sampling and keeps them, verifies the first
``num_spec_tokens`` of them (padded with -1) against its 'model' (``token_for``), emits the
accepted run plus the target's own token, keeps its own computed count (the engine core's may be
ahead under async scheduling), and writes a fake KV entry for every position it runs, drafts
included, checking every slot a position reads (so a rejected draft's KV that is read before
being rewritten shows up).

Like the runner, its result has no ``spec_token_ids`` at all when it proposed nothing, and it
shares no list with the engine core (the bus sends bytes).

``draft_for(req_id, position)`` is the proposer: the true token there (an oracle, like the target
drafting for itself) or a wrong one; ``None`` ends the drafts early (an n-gram that found less).
"""

from __future__ import annotations

from collections.abc import Callable

from shoal.bus.messages.worker import ExecuteStep, StepResult
from tests.unit.factories import FakeWorker, _WorkerRequest, default_token_for

DraftFor = Callable[[str, int], int | None]


def oracle(request_id: str, position: int) -> int | None:
    return default_token_for(request_id, position)


def wrong_every(period: int) -> DraftFor:
    """The true token, but a wrong one where (position % period == 0)."""

    def draft_for(request_id: str, position: int) -> int | None:
        token = default_token_for(request_id, position)
        return token + 1 if position % period == 0 else token

    return draft_for


class FakeSpecWorker(FakeWorker):
    def __init__(
        self,
        block_size: int,
        draft_for: DraftFor = oracle,
        token_for: Callable[[str, int], int] = default_token_for,
    ) -> None:
        super().__init__(block_size, token_for)
        self.draft_for = draft_for
        self.drafts: dict[str, list[int]] = {}
        self.num_verified = 0  # draft positions run
        self.max_position_written: dict[str, int] = {}

    def execute(self, step: ExecuteStep) -> StepResult:
        for req_id in [*step.finished_req_ids, *step.preempted_req_ids]:
            self.batch.pop(req_id, None)
            self.drafts.pop(req_id, None)
        runs: list[tuple[str, int, int, list[int]]] = []  # id, computed, known run, drafts
        for new in step.new_requests:
            self.batch[new.req_id] = _WorkerRequest(
                new.prompt_token_ids + new.output_token_ids,
                list(new.block_ids),
                new.num_computed_tokens,
            )
            self.drafts.pop(new.req_id, None)
            runs.append((new.req_id, new.num_computed_tokens, new.num_scheduled_tokens, []))
        for cached in step.cached_requests:
            state = self.batch[cached.req_id]
            assert cached.num_computed_tokens >= state.num_computed_tokens, cached
            state.block_ids.extend(cached.new_block_ids)
            n = cached.num_spec_tokens
            drafts = (list(self.drafts.get(cached.req_id, []))[:n] + [-1] * n)[:n]
            known_run = cached.num_scheduled_tokens - n
            runs.append((cached.req_id, state.num_computed_tokens, known_run, drafts))
        for req_id, start, known_run, drafts in runs:
            self._write_kv(req_id, start, start + known_run)
            self._write_drafts(req_id, start + known_run, drafts)
        sampled = [self._verify(req_id, start + n, drafts) for req_id, start, n, drafts in runs]
        spec = self._propose(runs, sampled, step.num_spec_tokens)
        return StepResult(step.step_id, [run[0] for run in runs], sampled, spec_token_ids=spec)

    def _write_drafts(self, req_id: str, start: int, drafts: list[int]) -> None:
        state = self.batch[req_id]
        assert len(state.block_ids) * self.block_size >= start + len(drafts), (req_id, start)
        for offset, token in enumerate(drafts):
            self.kv[self._slot(state, start + offset)] = (start + offset, token)
        self.num_verified += len(drafts)

    def _verify(self, req_id: str, end: int, drafts: list[int]) -> list[int]:
        state = self.batch[req_id]
        if end < len(state.token_ids):
            state.num_computed_tokens = end
            return []  # part-way through the prompt
        emitted: list[int] = []
        for offset in range(len(drafts) + 1):
            position = end + offset
            for earlier in range(position):  # attention reads every earlier slot
                want = state.token_ids[earlier] if earlier < end else emitted[earlier - end]
                slot = self._slot(state, earlier)
                assert self.kv.get(slot) == (earlier, want), (req_id, earlier, self.kv.get(slot))
            token = self.token_for(req_id, position)
            emitted.append(token)
            if offset == len(drafts) or drafts[offset] != token:
                break
        state.token_ids.extend(emitted)
        state.num_computed_tokens = len(state.token_ids) - 1
        return emitted

    def _propose(
        self, runs: list[tuple[str, int, int, list[int]]], sampled: list[list[int]], k: int
    ) -> list[list[int]]:
        if not k:
            return []
        proposed: list[list[int]] = []
        for (req_id, *_), tokens in zip(runs, sampled, strict=True):
            drafts: list[int] = []
            if tokens:
                first = len(self.batch[req_id].token_ids)
                for position in range(first, first + k):
                    token = self.draft_for(req_id, position)
                    if token is None:
                        break
                    drafts.append(token)
                self.drafts[req_id] = drafts
            proposed.append(list(drafts))
        return proposed if any(proposed) else []  # as the runner: [] when nothing was proposed
