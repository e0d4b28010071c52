"""SamplingBatch: penalties against a plain Python reference, and the incremental per-step path."""

from __future__ import annotations

import pytest
import torch

from shoal.bus.messages.sampling import SamplingParams
from shoal.workers.request_store import RequestStore
from shoal.workers.sampler import apply_penalties
from shoal.workers.sampling_metadata import SamplingBatch

VOCAB = 16


def sampling_batch(vocab: int) -> SamplingBatch:
    """A metadata builder over its own request store (the runner shares one with its batch)."""
    return SamplingBatch(RequestStore(max_num_reqs=4096, vocab_size=vocab))


def _reference_penalties(
    logits: list[float], prompt: list[int], output: list[int], params: SamplingParams
) -> list[float]:
    """vLLM/OpenAI penalties, one token at a time."""
    result = []
    for token, value in enumerate(logits):
        if token in prompt or token in output:
            if value > 0:
                value /= params.repetition_penalty
            else:
                value *= params.repetition_penalty
        value -= params.frequency_penalty * output.count(token)
        value -= params.presence_penalty * (1.0 if token in output else 0.0)
        result.append(value)
    return result


CASES = [
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6),
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=-0.8),
    SamplingParams(presence_penalty=0.4, frequency_penalty=1.1, repetition_penalty=1.3),
    SamplingParams(),  # no penalty: the row must be left untouched
]


@pytest.mark.parametrize("rows", [list(range(len(CASES))), [4, 0, 5, 2]])
def test_penalties_match_the_reference(rows: list[int]) -> None:
    gen = torch.Generator().manual_seed(0)
    batch = sampling_batch(VOCAB)
    prompts, outputs = {}, {}
    for i in rows:
        prompts[i] = torch.randint(0, VOCAB, (5,), generator=gen).tolist()
        outputs[i] = torch.randint(0, VOCAB, (i + 3,), generator=gen).tolist()
        batch.requests.add(f"r{i}", CASES[i], prompts[i], output_token_ids=outputs[i])
    logits = torch.randn(len(rows), VOCAB, generator=gen) * 2
    meta = batch.prepare([f"r{i}" for i in rows])
    assert meta.penalties is not None
    penalized = logits.clone()
    apply_penalties(penalized, meta.penalties)
    for slot, i in enumerate(rows):
        expected = _reference_penalties(logits[slot].tolist(), prompts[i], outputs[i], CASES[i])
        torch.testing.assert_close(penalized[slot], torch.tensor(expected))


def test_no_penalties_means_no_penalty_tensors() -> None:
    batch = sampling_batch(VOCAB)
    batch.requests.add("a", SamplingParams(temperature=0.0), [1, 2])
    meta = batch.prepare(["a"])
    assert meta.penalties is None
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None
    assert meta.all_greedy and not meta.all_random
    assert meta.generators == {}  # a seed on a greedy request needs no generator


def test_same_rows_reuse_the_metadata_and_bump_output_counts() -> None:
    batch = sampling_batch(VOCAB)
    batch.requests.add("a", SamplingParams(frequency_penalty=1.0), [1], output_token_ids=[3])
    batch.requests.add("b", SamplingParams(temperature=0.5), [2])
    batch.requests.add("c", SamplingParams(presence_penalty=0.5, min_tokens=2), [4], [], [0])
    first = batch.prepare(["a", "b", "c"])
    assert first.min_tokens_blocked is not None
    for step_tokens in ([3, 7, 5], [9, 9, 5]):
        for req_id, token in zip("abc", step_tokens, strict=True):
            batch.requests[req_id].output_token_ids.append(token)
        again = batch.prepare(["a", "b", "c"])
        assert again is first
    assert first.penalties is not None
    fresh = sampling_batch(VOCAB)
    fresh.requests.add("a", SamplingParams(frequency_penalty=1.0), [1], [3, 3, 9])
    fresh.requests.add("b", SamplingParams(temperature=0.5), [2])
    fresh.requests.add("c", SamplingParams(presence_penalty=0.5, min_tokens=2), [4], [5, 5], [0])
    rebuilt = fresh.prepare(["a", "b", "c"])
    assert rebuilt.penalties is not None
    torch.testing.assert_close(first.penalties.output_counts, rebuilt.penalties.output_counts)
    assert first.penalties.output_counts[0, 3].item() == 2
    assert first.min_tokens_blocked is None  # c has two outputs now


def test_changed_rows_rebuild() -> None:
    batch = sampling_batch(VOCAB)
    batch.requests.add("a", SamplingParams(temperature=0.0), [1])
    batch.requests.add("b", SamplingParams(temperature=0.9, top_k=4, logprobs=3), [1])
    ab = batch.prepare(["a", "b"])
    ba = batch.prepare(["b", "a"])
    assert ba is not ab
    assert ba.is_greedy.tolist() == [False, True]
    assert ba.top_k is not None and ba.top_k.tolist() == [4, VOCAB]
    assert ba.num_logprobs == [3, None] and ba.max_num_logprobs == 3
    batch.requests.remove("a")
    assert "a" not in batch.requests
    only_b = batch.prepare(["b"])
    assert only_b.all_random and only_b.temperature.tolist() == pytest.approx([0.9])


def test_stop_ids_outside_the_vocabulary_are_ignored() -> None:
    batch = sampling_batch(VOCAB)
    params = SamplingParams(min_tokens=1, stop_token_ids=[VOCAB + 5, 2])
    batch.requests.add("a", params, [1], eos_token_ids=[VOCAB])
    blocked = batch.prepare(["a"]).min_tokens_blocked
    assert blocked is not None
    assert blocked[1].tolist() == [2]
