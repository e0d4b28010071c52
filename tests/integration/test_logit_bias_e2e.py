"""logit_bias and allowed_token_ids through the real stack (engine client, engine core, worker,
tiny model): restricted greedy outputs use only the allowed tokens while the plain requests of the
same batches equal transformers' greedy; the same with n-gram speculative decoding on (the markov
model's outputs loop, so drafts are verified); ids out of the vocabulary are a clean error."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from shoal.bus.messages.sampling import SamplingParams
from shoal.engine.client.interface import RequestValidationError
from tests.fixtures.models import make_prompts
from tests.integration.engine_stack import engine_stack

pytestmark = pytest.mark.timeout(180)

MAX_TOKENS = 10
ALLOWED = [17, 42, 99, 150, 230]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


async def _tokens(client: Any, prompt: list[int], params: SamplingParams, req_id: str) -> Any:
    final = None
    async for output in client.generate(prompt, params, req_id):
        final = output
    assert final is not None and final.finished
    return final.outputs[0].token_ids


async def _mixed_batch(client: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Per prompt: plain greedy, greedy restricted to ALLOWED, and greedy with +100 on token 7."""
    kinds: dict[str, dict[str, Any]] = {
        "plain": {},
        "allowed": {"allowed_token_ids": ALLOWED},
        "bias": {"logit_bias": {7: 100.0}},
    }
    jobs = {
        f"{kind}{i}": _tokens(
            client,
            prompt,
            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra),
            f"{kind}{i}",
        )
        for kind, extra in kinds.items()
        for i, prompt in enumerate(prompts)
    }
    outputs = await asyncio.gather(*jobs.values())
    return dict(zip(jobs, outputs, strict=True))


async def test_restricted_requests_beside_plain_ones(bus_factory, tiny_checkpoint, hf_reference):  # type: ignore[no-untyped-def]
    model_dir = tiny_checkpoint("llama")
    prompts = make_prompts()
    expected = hf_reference(model_dir, prompts, MAX_TOKENS)
    bus = await bus_factory()
    async with engine_stack(bus, model_dir) as stack:
        got = await _mixed_batch(stack.client, prompts, MAX_TOKENS)
    for i, want in enumerate(expected):
        assert got[f"plain{i}"] == want
        assert set(got[f"allowed{i}"]) <= set(ALLOWED) and len(got[f"allowed{i}"]) == MAX_TOKENS
        assert got[f"bias{i}"] == [7] * MAX_TOKENS
    assert len({t for i in range(len(prompts)) for t in got[f"allowed{i}"]}) > 1


async def test_speculative_decoding_obeys_them(bus_factory, markov_checkpoint):  # type: ignore[no-untyped-def]
    prompts = [[40, 41, 42], [7] * 12, [17, 42, 99, 17, 42]]
    runs = {}
    spec_options: dict[str, Any] = {"speculative_config": NGRAM}
    for name, options in (("plain", {}), ("ngram", spec_options)):
        bus = await bus_factory()
        async with engine_stack(bus, markov_checkpoint, **options) as stack:
            runs[name] = await _mixed_batch(stack.client, prompts, 32)
            spec = stack.engines[0].core.scheduler.spec  # type: ignore[union-attr]
            if spec is not None:
                assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens > 0
    assert runs["ngram"] == runs["plain"]
    for i in range(len(prompts)):
        assert set(runs["ngram"][f"allowed{i}"]) <= set(ALLOWED)
        assert runs["ngram"][f"bias{i}"] == [7] * 32


async def test_ids_out_of_the_vocabulary_are_a_clean_error(bus_factory, tiny_checkpoint):  # type: ignore[no-untyped-def]
    model_dir = tiny_checkpoint("llama")
    bus = await bus_factory()
    async with engine_stack(bus, model_dir) as stack:
        vocab = stack.client.vocabulary.model_vocab_size
        for field, extra in (
            ("logit_bias", {"logit_bias": {vocab: 1.0}}),
            ("allowed_token_ids", {"allowed_token_ids": [1, vocab + 5]}),
        ):
            params = SamplingParams(temperature=0.0, max_tokens=2, **extra)  # type: ignore[arg-type]
            with pytest.raises(RequestValidationError) as caught:
                await _tokens(stack.client, [5, 6], params, f"bad-{field}")
            assert caught.value.param == field and str(vocab) in str(caught.value)
        # the engine keeps serving
        assert len(await _tokens(stack.client, [5, 6], SamplingParams(max_tokens=2), "ok")) == 2
