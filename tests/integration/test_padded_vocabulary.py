"""vLLM's vocabulary rule on a model whose embedding is larger than its tokenizer (a tiny Qwen2
with 384 rows and the 320-token test tokenizer, as Qwen pads its embedding): prompt ids between
the two are taken (over HTTP, the NATS API and offline) and the greedy output equals
transformers' token for token; an id past both, or a negative one, is vLLM's "Token id N is out
of vocabulary", a 400 in OpenAI's shape after which the server still answers; a generated id the
tokenizer does not know decodes to nothing, as vLLM's detokenizer gives it (text and logprob
token alike), and the stream goes on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from shoal import LLM, SamplingParams
from shoal.engine.client.interface import RequestValidationError
from shoal.gateway.nats_api import NatsApi
from shoal.gateway.serving import serving_context
from tests.fixtures.models import TINY_VOCAB, hf_greedy
from tests.integration.served_stack import ServedStack, served_stack

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
EMBEDDING_ROWS = 384  # config.json's vocab_size; the tokenizer has TINY_VOCAB (320) ids
PADDED_IDS = [TINY_VOCAB, 350, EMBEDDING_ROWS - 1]  # rows the tokenizer never produces
PROMPT = [5, *PADDED_IDS, 60, 12]
UNKNOWN = 350  # an id to force out of the model: it has no text
KNOWN = 41  # one the tokenizer decodes (to one character)
NUM_TOKENS = 8


@pytest.fixture
def padded_model(tiny_checkpoint) -> Path:  # type: ignore[no-untyped-def]
    return tiny_checkpoint("qwen2", vocab_size=EMBEDDING_ROWS)  # type: ignore[no-any-return]


def _client(served: ServedStack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0)


async def test_prompt_ids_up_to_the_embedding_are_taken_over_http_and_nats(padded_model) -> None:  # type: ignore[no-untyped-def]
    expected = hf_greedy(padded_model, [PROMPT], NUM_TOKENS)[0]
    greedy = {"temperature": 0, "max_tokens": NUM_TOKENS, "ignore_eos": True}
    async with served_stack(padded_model) as served:
        tokenizer = served.stack.client.tokenizer
        answer = await _client(served).completions.create(
            model="tiny", prompt=PROMPT, max_tokens=NUM_TOKENS, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert answer.usage is not None and answer.usage.prompt_tokens == len(PROMPT)
        assert answer.usage.completion_tokens == NUM_TOKENS
        assert answer.choices[0].text == tokenizer.decode(expected)
        nats = NatsApi(served.stack.client.bus, serving_context(served.stack.client))
        await nats.start()
        try:
            request = {"prompt_token_ids": PROMPT, "sampling_params": greedy}
            reply = await nats.bus.request(
                nats.subjects.api_generate(), json.dumps(request).encode(), timeout=30
            )
            result = json.loads(reply.data)
            assert result["type"] == "result", result
            assert result["choices"][0]["token_ids"] == expected
            past = {"prompt_token_ids": [5, EMBEDDING_ROWS], "sampling_params": greedy}
            reply = await nats.bus.request(
                nats.subjects.api_generate(), json.dumps(past).encode(), timeout=30
            )
            refused = json.loads(reply.data)
            assert refused["type"] == "error" and refused["status"] == 400, refused
            assert refused["error"]["message"] == f"Token id {EMBEDDING_ROWS} is out of vocabulary"
        finally:
            await nats.stop()
        await served.wait_until_idle()


async def test_an_id_past_the_embedding_is_a_400_and_the_server_goes_on(padded_model) -> None:  # type: ignore[no-untyped-def]
    async with served_stack(padded_model) as served, aiohttp.ClientSession() as session:
        for prompt in ([5, EMBEDDING_ROWS], [[5, 6], [EMBEDDING_ROWS + 7]]):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
            async with session.post(served.url + "/v1/completions", json=body) as response:
                assert response.status == 400
                error = (await response.json())["error"]
            high = max(p if isinstance(p, int) else max(p) for p in prompt)
            assert error == {
                "message": f"Token id {high} is out of vocabulary",
                "type": "invalid_request_error",
                "param": "prompt",
                "code": "invalid_value",
            }
        answer = await _client(served).completions.create(
            model="tiny", prompt=[5, EMBEDDING_ROWS - 1], max_tokens=2,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert answer.usage is not None and answer.usage.completion_tokens == 2
        await served.wait_until_idle()
        assert served.num_started() == 1  # the refused ones never reached the engine


async def _stream_text(served: ServedStack, body: dict[str, Any]) -> tuple[str, str | None]:
    """A streamed completion: its text and finish reason."""
    text, reason = "", None
    async with (
        aiohttp.ClientSession() as session,
        session.post(served.url + "/v1/completions", json=body) as response,
    ):
        assert response.status == 200, await response.text()
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: ") :])["choices"]:
                text += choice["text"]
                reason = choice["finish_reason"] or reason
    return text, reason


async def test_a_generated_id_the_tokenizer_lacks_decodes_to_nothing(padded_model) -> None:  # type: ignore[no-untyped-def]
    forced = {"temperature": 0, "ignore_eos": True, "logit_bias": {str(UNKNOWN): 100}}
    served_template = "{{ messages[0]['content'] }}"  # its tokenizer ships none
    async with served_stack(padded_model, chat_template=served_template) as served:
        client = _client(served)
        whole = await client.completions.create(
            model="tiny", prompt="the quick brown fox", max_tokens=4, logprobs=1, extra_body=forced
        )
        choice = whole.choices[0]
        assert choice.text == "" and choice.finish_reason == "length"
        assert whole.usage is not None and whole.usage.completion_tokens == 4
        assert choice.logprobs is not None and choice.logprobs.tokens == [""] * 4
        chat = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            logprobs=True,
            extra_body=forced,
        )
        assert chat.choices[0].message.content == ""
        assert chat.choices[0].logprobs is not None
        assert [t.token for t in chat.choices[0].logprobs.content or []] == [""] * 3
        # sampled among it and an id with text: the text is that id's alone, and the stream
        # goes on past the unknown ones (both are drawn: each is an even chance at 50 degrees)
        known = served.stack.client.tokenizer.decode([KNOWN])
        mixed = {"temperature": 50.0, "seed": 0, "allowed_token_ids": [UNKNOWN, KNOWN]}
        body = {"model": "tiny", "prompt": "the fox", "max_tokens": 12, "stream": True}
        text, reason = await _stream_text(served, {**body, **mixed, "ignore_eos": True})
        assert reason == "length" and 0 < len(text) < 12 and text == known * len(text)
        await served.wait_until_idle()


def test_offline_takes_the_same_ids_and_refuses_the_same(padded_model) -> None:  # type: ignore[no-untyped-def]
    expected = hf_greedy(padded_model, [PROMPT], NUM_TOKENS)[0]
    greedy = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    forced = SamplingParams(
        temperature=0, max_tokens=3, ignore_eos=True, logit_bias={UNKNOWN: 100}, logprobs=0
    )
    with LLM(str(padded_model), num_gpu_blocks_override=64) as llm:
        out = llm.generate({"prompt_token_ids": PROMPT}, greedy, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == expected
        unknown = llm.generate("the fox", forced, use_tqdm=False)[0].outputs[0]
        assert unknown.token_ids == [UNKNOWN] * 3 and unknown.text == ""
        assert unknown.logprobs is not None
        assert [p[UNKNOWN].decoded_token for p in unknown.logprobs] == [""] * 3
        mixed = SamplingParams(
            temperature=50.0, seed=0, max_tokens=12, ignore_eos=True,
            allowed_token_ids=[UNKNOWN, KNOWN],
        )  # fmt: skip
        both = llm.generate("the fox", mixed, use_tqdm=False)[0].outputs[0]
        assert {UNKNOWN, KNOWN} == set(both.token_ids)
        assert both.text == llm.get_tokenizer().decode([KNOWN]) * both.token_ids.count(KNOWN)
        for bad in (EMBEDDING_ROWS, -1):
            with pytest.raises(RequestValidationError, match=f"Token id {bad} is out of vocab"):
                llm.generate({"prompt_token_ids": [5, bad]}, greedy, use_tqdm=False)
