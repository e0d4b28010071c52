"""Structured outputs in the scheduler (``engine/core/grammar.py``), with a scripted grammar
backend: a request with a grammar waits apart until its grammar compiles (counted as waiting),
then runs; a failed compile finishes it with the error; only the grammar requests that sample in
a step get a bitmask row (a step without any carries none); sampled tokens advance the matcher
and a refused one fails the request; an abort while compiling releases it; under async
scheduling a grammar request is not scheduled again before its previous token lands; under
speculative decoding it verifies only its grammar's valid prefix of its drafts, with a bitmask
row per position."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from shoal.bus.messages.spec_decode import SpeculativeConfig
from shoal.bus.messages.structured import GrammarBitmask, StructuredOutputsParams
from shoal.engine.core.grammar import GrammarState
from shoal.engine.core.request import RequestStatus
from tests.unit.factories import (
    FakeWorker,
    Pipeline,
    make_request,
    make_scheduler,
    run_to_completion,
)

REGEX = StructuredOutputsParams(regex="[0-9]+")
REFUSED = 13  # the scripted grammar refuses this token


class ScriptedGrammars:
    """Compiles when told; accepts every token but ``REFUSED``; records what it was asked."""

    def __init__(self) -> None:
        self.compiled: set[str] = set()
        self.errors: dict[str, str] = {}
        self.started: dict[str, list[int]] = {}
        self.accepted: dict[str, list[int]] = {}
        self.masked: list[list[str]] = []
        self.drafts_seen: list[dict[str, list[int]]] = []
        self.released: list[str] = []

    def start(
        self, request_id: str, params: StructuredOutputsParams, output_token_ids: Sequence[int]
    ) -> None:
        self.started[request_id] = list(output_token_ids)

    def state(self, request_id: str) -> tuple[GrammarState, str]:
        if request_id in self.errors:
            return GrammarState.FAILED, self.errors[request_id]
        if request_id in self.compiled:
            return GrammarState.READY, ""
        return GrammarState.COMPILING, ""

    def accept(self, request_id: str, token_ids: Sequence[int]) -> bool:
        self.accepted.setdefault(request_id, []).extend(token_ids)
        return REFUSED not in token_ids

    def valid_prefix(self, request_id: str, token_ids: Sequence[int]) -> int:
        return list(token_ids).index(REFUSED) if REFUSED in token_ids else len(token_ids)

    def bitmask(
        self, request_ids: Sequence[str], drafts: Mapping[str, Sequence[int]]
    ) -> GrammarBitmask:
        rows = [rid for rid in request_ids for _ in range(len(drafts.get(rid, ())) + 1)]
        self.masked.append(rows)
        self.drafts_seen.append({rid: list(d) for rid, d in drafts.items()})
        return GrammarBitmask(rows, 1, b"\xff\xff\xff\xff" * len(rows))

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


def _setup(**overrides):  # type: ignore[no-untyped-def]
    grammars = ScriptedGrammars()
    scheduler = make_scheduler(grammar_backend=grammars, **overrides)
    scheduler.add_request(make_request("g", [1, 2, 3, 4], structured_outputs=REGEX))
    scheduler.add_request(make_request("free", [5, 6, 7, 8]))
    return grammars, scheduler


def test_a_grammar_request_waits_for_its_grammar_then_runs_with_a_mask_row() -> None:
    grammars, scheduler = _setup()
    assert grammars.started == {"g": []}
    step = scheduler.schedule()
    assert set(step.num_scheduled_tokens) == {"free"} and step.grammar is None
    assert scheduler.num_waiting == 1  # still compiling
    worker = FakeWorker(scheduler.block_size)
    scheduler.update_from_output(step, worker.execute(step.to_message()))
    grammars.compiled.add("g")
    assert scheduler.admit_compiled() == []
    step = scheduler.schedule()
    assert set(step.num_scheduled_tokens) == {"g", "free"}
    message = step.to_message()
    assert message.grammar is not None and message.grammar.req_ids == ["g"]
    outputs = scheduler.update_from_output(step, worker.execute(message))
    (g_output,) = [o for o in outputs["client"] if o.request_id == "g"]
    assert grammars.accepted["g"] == g_output.new_token_ids
    assert "free" not in grammars.accepted
    run_to_completion(scheduler, worker)
    assert grammars.released == ["g"] and scheduler.grammars is not None
    assert scheduler.grammars.num_active == 0  # steps skip the grammar work again


def test_a_grammar_that_fails_to_compile_finishes_the_request_with_its_error() -> None:
    grammars, scheduler = _setup()
    grammars.errors["g"] = "grammar not compiled: bad regex"
    (failed,) = scheduler.admit_compiled()
    assert failed.status is RequestStatus.FINISHED_ERROR
    assert failed.make_final_output().finish_reason == "error"
    assert failed.error == "grammar not compiled: bad regex"
    assert "g" not in scheduler.requests and grammars.released == ["g"]
    assert scheduler.num_waiting == 1  # the free one
    assert scheduler.grammars is not None and scheduler.grammars.num_active == 0


def test_a_refused_token_fails_the_request() -> None:
    grammars, scheduler = _setup()
    grammars.compiled.add("g")
    scheduler.admit_compiled()
    worker = FakeWorker(scheduler.block_size, token_for=lambda req_id, _: REFUSED)
    step = scheduler.schedule()
    outputs = scheduler.update_from_output(step, worker.execute(step.to_message()))
    finals = [o for o in outputs["client"] if o.request_id == "g" and o.finish_reason]
    assert [o.finish_reason for o in finals] == ["error"]
    assert "g" not in scheduler.requests and "free" in scheduler.requests


def test_an_abort_while_compiling_releases_the_request() -> None:
    grammars, scheduler = _setup()
    (aborted,) = scheduler.finish_requests("g", RequestStatus.FINISHED_ABORTED)
    assert aborted.request_id == "g" and grammars.released == ["g"]
    assert scheduler.grammars is not None and scheduler.grammars.num_active == 0
    grammars.compiled.add("g")
    assert scheduler.admit_compiled() == [] and scheduler.num_waiting == 1


def test_no_backend_refuses_a_grammar_request() -> None:
    scheduler = make_scheduler()
    with pytest.raises(ValueError, match="structured outputs are not available"):
        scheduler.add_request(make_request("g", [1, 2, 3], structured_outputs=REGEX))


def test_async_scheduling_waits_for_a_grammar_requests_previous_token() -> None:
    grammars, scheduler = _setup(async_scheduling=True)
    grammars.compiled.add("g")
    scheduler.admit_compiled()
    pipeline = Pipeline(scheduler, FakeWorker(scheduler.block_size), depth=2)
    first = pipeline.schedule()
    second = pipeline.schedule()
    assert first is not None and second is not None
    assert set(first.num_scheduled_tokens) == {"g", "free"}
    assert set(second.num_scheduled_tokens) == {"free"}  # g's mask needs its first token
    assert second.grammar is None
    pipeline.land()
    third = pipeline.schedule()
    assert third is not None and "g" in third.num_scheduled_tokens
    assert third.grammar is not None and third.grammar.req_ids == ["g"]
    assert len(grammars.accepted["g"]) == 1  # the first token was fed before its next mask


def test_a_grammar_request_verifies_only_the_drafts_its_grammar_accepts() -> None:
    ngram = SpeculativeConfig(speculative_method="ngram", num_speculative_tokens=3)
    grammars, scheduler = _setup(speculative_config=ngram)
    grammars.compiled.add("g")
    scheduler.admit_compiled()
    worker = FakeWorker(scheduler.block_size)
    step = scheduler.schedule()
    scheduler.update_from_output(step, worker.execute(step.to_message()))
    scheduler.requests["g"].spec_token_ids = [40, 41, REFUSED]
    scheduler.requests["free"].spec_token_ids = [40, 41, REFUSED]
    step = scheduler.schedule()
    assert step.num_spec_tokens == {"g": 2, "free": 3}
    assert step.grammar is not None and step.grammar.req_ids == ["g", "g", "g"]  # 2 drafts + 1
    assert grammars.masked[-1] == ["g", "g", "g"]
    assert grammars.drafts_seen[-1] == {"g": [40, 41]}  # their values, not placeholders
