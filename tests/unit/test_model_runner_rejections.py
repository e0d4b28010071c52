"""Fatal or not: a request whose own inputs the model cannot take (a token id outside the
vocabulary, more tokens than max_model_len) fails alone with a non-fatal StepError while the
other requests of its step run as if it had not been there; later steps that still schedule it
fail it alone again until the engine core finishes it. A fault elsewhere stays fatal. With fault
tolerance on and TP > 1 the runner loads its shard without joining any group."""

from __future__ import annotations

import pytest
import torch

from shoal.bus.messages.worker import CachedRequestData, ExecuteStep, NewRequestData
from shoal.workers.actor import execute_or_explain
from shoal.workers.rejections import reject_reason
from tests.golden.driver import make_runner
from tests.unit.test_model_runner import BLOCK, new

VOCAB = 320  # the tiny checkpoints' vocabulary


@pytest.fixture
def runner(tiny_checkpoint):  # type: ignore[no-untyped-def]
    r = make_runner(tiny_checkpoint("llama"), num_blocks=64, block_size=BLOCK, max_model_len=64)
    facts = r.load()
    assert facts.vocab_size == VOCAB
    return r


def _decode(req_id: str, num_computed: int) -> CachedRequestData:
    return CachedRequestData(req_id, [], num_computed, 1)


def test_reasons_name_the_input_at_fault() -> None:
    ok = new("a", [1, 2, 3], [1], 3)
    assert reject_reason(ok, VOCAB, 64) is None
    assert "token id 320 is out of range (vocabulary size 320)" in str(
        reject_reason(new("b", [1, VOCAB], [1], 2), VOCAB, 64)
    )
    assert "token id -1" in str(reject_reason(new("b", [-1], [1], 1), VOCAB, 64))
    assert "exceed max_model_len=4" in str(reject_reason(new("b", [1] * 5, [1, 2], 5), VOCAB, 4))
    bias = new("b", [1], [1], 1, logit_bias={VOCAB: 5.0})
    assert "logit_bias has token id 320" in str(reject_reason(bias, VOCAB, 64))
    allowed = new("b", [1], [1], 1, allowed_token_ids=[3, VOCAB + 1])
    assert "allowed_token_ids has token id 321" in str(reject_reason(allowed, VOCAB, 64))
    assert reject_reason(new("b", [1], [1], 1, allowed_token_ids=[VOCAB - 1]), VOCAB, 64) is None


def test_a_bad_request_fails_alone_and_the_others_run(runner) -> None:  # type: ignore[no-untyped-def]
    alone = runner.execute(ExecuteStep(0, new_requests=[new("a", [5, 6, 7], [1], 3)]))
    runner.execute(ExecuteStep(1, finished_req_ids=["a"]))
    step = ExecuteStep(
        2,
        new_requests=[
            new("bad", [5, VOCAB + 3, 7], [2], 3),
            new("a", [5, 6, 7], [3], 3),
            new("long", list(range(1, 66)), list(range(4, 21)), 65),
        ],
    )
    result = execute_or_explain(runner, step)
    assert result.req_ids == ["a"] and result.sampled_token_ids == alone.sampled_token_ids
    assert result.error is not None and not result.error.fatal
    assert result.error.req_ids == ["bad", "long"]
    assert (
        f"token id {VOCAB + 3}" in result.error.message and "max_model_len" in result.error.message
    )
    assert "bad" not in runner.requests and "long" not in runner.requests
    # async scheduling: the next step was sent before this result came back
    token = result.sampled_token_ids[0][0]
    nxt = runner.execute(ExecuteStep(3, cached_requests=[_decode("bad", 3), _decode("a", 3)]))
    assert nxt.req_ids == ["a"] and nxt.error is not None and nxt.error.req_ids == ["bad"]
    assert not nxt.error.fatal
    assert runner.requests["a"].output_token_ids == [token, *nxt.sampled_token_ids[0]]
    # finished by the engine core: forgotten; the id may come back with good inputs
    again = runner.execute(
        ExecuteStep(
            4, new_requests=[new("bad", [5, 6, 7], [2], 3)], finished_req_ids=["bad", "long"]
        )
    )
    assert again.error is None and again.req_ids == ["bad"]
    assert again.sampled_token_ids == alone.sampled_token_ids


def test_a_step_of_refused_requests_only(runner) -> None:  # type: ignore[no-untyped-def]
    result = runner.execute(ExecuteStep(0, new_requests=[new("bad", [VOCAB], [1], 1)]))
    assert result.req_ids == [] and result.error is not None and result.error.req_ids == ["bad"]


def test_any_other_fault_of_a_step_is_fatal(runner) -> None:  # type: ignore[no-untyped-def]
    step = ExecuteStep(
        0, new_requests=[new("a", [1, 2, 3], [1], 3)], cached_requests=[_decode("ghost", 3)]
    )
    result = execute_or_explain(runner, step)
    assert result.error is not None and result.error.fatal
    assert result.error.req_ids == ["a", "ghost"]


def test_with_fault_tolerance_a_tp_rank_loads_without_joining_a_group(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    r = make_runner(
        tiny_checkpoint("llama"),
        num_blocks=8,
        block_size=BLOCK,
        tp_rank=1,
        tensor_parallel_size=2,
        fault_tolerance_config={},
    )  # no tp_init_method: joining at load would raise
    r.load()
    assert r.group is not None and (r.group.rank, r.group.size) == (1, 2)
    assert not torch.distributed.is_initialized()


def test_resumed_output_tokens_are_checked_too() -> None:
    resumed = NewRequestData("r", [1, 2], new("r", [1], [1], 1).sampling_params, [1], 0, 3, [VOCAB])
    assert "output token id 320" in str(reject_reason(resumed, VOCAB, 64))
