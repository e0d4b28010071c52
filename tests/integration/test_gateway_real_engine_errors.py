"""The bad-input table and the fuzzer through the real engine (worker, engine core and client
behind the gateway, started once for the module), plus inputs only the tokenizer or the engine can
judge: token ids out of range, prompts at and one token over the context, huge ``n``, empty
prompts, and echoed token ids that are not valid UTF-8 on their own. No answer is a 500, none
hangs, and afterwards a normal request succeeds with the engine core idle (no request left, every
KV block free) and the gateway's accounting settled."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from shoal.bus.messages.sampling import SamplingParams
from shoal.engine.client.interface import RequestValidationError
from tests.integration.served_stack import ServedStack, served_stack, with_chat_template
from tests.integration.test_gateway_errors import BAD_INPUTS, check_bad_inputs
from tests.integration.test_gateway_fuzz import fuzz

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

CMPL = "/v1/completions"
TIMEOUT = aiohttp.ClientTimeout(total=60)  # no request may hang


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tiny_checkpoint, tmp_path_factory) -> AsyncIterator[ServedStack]:  # type: ignore[no-untyped-def]
    model_dir = with_chat_template(tiny_checkpoint("llama"), tmp_path_factory.mktemp("m") / "m")
    async with served_stack(model_dir) as stack:
        yield stack


@pytest_asyncio.fixture(loop_scope="module")
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as client_session:
        yield client_session


async def _still_healthy(served: ServedStack, session: aiohttp.ClientSession) -> None:
    await served.wait_until_idle()
    async with session.get(served.url + "/health") as response:
        assert response.status == 200
    body = {"prompt": "the quick", "max_tokens": 3, "ignore_eos": True}
    async with session.post(served.url + CMPL, json=body) as response:
        assert response.status == 200, await response.text()
        assert (await response.json())["choices"][0]["finish_reason"] == "length"
    await served.wait_until_idle()


def _engine_only_inputs(served: ServedStack) -> list[tuple[str, Any, int, str | None, str | None]]:
    """Bad inputs that only this model's tokenizer or context can refuse."""
    vocab_size = len(served.stack.client.tokenizer)
    max_len = served.stack.client.max_model_len
    over = {"prompt": [5] * max_len}  # no room left for one generated token
    return [
        (CMPL, {"prompt": [vocab_size]}, 400, "invalid_value", "prompt"),
        (CMPL, {"prompt": [[5, 6], [vocab_size + 7]]}, 400, "invalid_value", "prompt"),
        (CMPL, {"prompt": [-1, 5]}, 400, "invalid_value", "prompt"),
        (CMPL, over, 400, "context_length_exceeded", "prompt"),
        (CMPL, {**over, "max_tokens": 1}, 400, "context_length_exceeded", "prompt"),
        (CMPL, {"prompt": [[5], over["prompt"]]}, 400, "context_length_exceeded", "prompt"),
        (CMPL, {"prompt": "hi", "n": 129}, 400, "invalid_value", "n"),
        (CMPL, {"prompt": "hi", "n": 2**62}, 400, "invalid_value", "n"),
        (CMPL, {"prompt": ["hi"] * 9, "n": 128}, 400, "invalid_value", "n"),
        (CMPL, {"prompt": ""}, 400, "invalid_value", "prompt"),
        (CMPL, {"prompt": ["hi", ""]}, 400, "invalid_value", "prompt"),
        (CMPL, {"prompt": []}, 400, "invalid_value", "prompt"),
        (CMPL, {"prompt": [[5], []]}, 400, "invalid_value", "prompt"),
    ]


async def test_bad_inputs_through_the_real_engine(
    served: ServedStack, session: aiohttp.ClientSession
) -> None:
    assert served.stack.client.tokenizer.encode("") == []  # so "" is an empty prompt here
    await check_bad_inputs(session, served.url, [*BAD_INPUTS, *_engine_only_inputs(served)])
    await _still_healthy(served, session)


async def test_prompt_at_the_context_limit_and_huge_n_are_served(
    served: ServedStack, session: aiohttp.ClientSession
) -> None:
    max_len = served.stack.client.max_model_len
    at_limit = {"prompt": [5] * (max_len - 1), "max_tokens": 2, "ignore_eos": True}
    async with session.post(served.url + CMPL, json=at_limit) as response:
        assert response.status == 400  # vLLM's answer: max_tokens beyond the room left
        assert (await response.json())["error"]["param"] == "max_tokens"
    at_limit["max_tokens"] = 1  # exactly the room left
    async with session.post(served.url + CMPL, json=at_limit) as response:
        assert response.status == 200, await response.text()
        body = await response.json()
    assert body["usage"] == {
        "prompt_tokens": max_len - 1,
        "completion_tokens": 1,
        "total_tokens": max_len,
    }
    assert body["choices"][0]["finish_reason"] == "length"
    many = {"prompt": "hi", "n": 128, "max_tokens": 2, "ignore_eos": True, "temperature": 1.0}
    async with session.post(served.url + CMPL, json=many) as response:
        assert response.status == 200, await response.text()
        choices = (await response.json())["choices"]
    assert sorted(c["index"] for c in choices) == list(range(128))
    assert all(c["finish_reason"] == "length" for c in choices)
    await _still_healthy(served, session)


def _lone_byte_ids(served: ServedStack) -> list[int]:
    """Ids of byte-level BPE tokens that are one byte of a multi-byte UTF-8 character: not valid
    UTF-8 on their own."""
    tokenizer = served.stack.client.tokenizer
    ids = [i for i in range(len(tokenizer)) if "\ufffd" in tokenizer.decode([i])]
    assert len(ids) >= 3
    return ids[:3]


async def test_echo_of_token_ids_that_are_not_utf8(
    served: ServedStack, session: aiohttp.ClientSession
) -> None:
    prompt = [75, *_lone_byte_ids(served), 76]
    base = {"prompt": prompt, "echo": True, "max_tokens": 2, "ignore_eos": True}
    for extra in ({}, {"logprobs": 2}, {"stream": True}, {"stream": True, "logprobs": 1}):
        body = {**base, **extra}
        async with session.post(served.url + CMPL, json=body) as response:
            assert response.status == 200, (body, await response.text())
            text = await response.text()
        if not body.get("stream"):
            choice = json.loads(text)["choices"][0]
            assert "\ufffd" in choice["text"]
            if "logprobs" in body:
                logprobs = choice["logprobs"]
                assert len(logprobs["tokens"]) == len(prompt) + 2
                assert logprobs["token_logprobs"][0] is None
            continue
        events = [line[len("data: ") :] for line in text.split("\n\n") if line]
        assert events[-1] == "[DONE]" and '"error"' not in text, text
        chunks = [json.loads(event) for event in events[:-1]]
        assert "\ufffd" in "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    await _still_healthy(served, session)


async def test_random_bodies_through_the_real_engine(
    served: ServedStack, session: aiohttp.ClientSession
) -> None:
    statuses = await fuzz(session, served.url, random.Random(4321), 120)
    assert statuses.get(200, 0) > 10 and statuses.get(400, 0) > 10  # both paths exercised
    await _still_healthy(served, session)


async def test_engine_client_refuses_token_ids_out_of_range(served: ServedStack) -> None:
    """Any front end (the offline API too) gets a validation error, not a model-runner failure
    or an encoding error, and the client tracks nothing of the refused request."""
    client = served.stack.client
    params = SamplingParams(max_tokens=2)
    for ids in ([5, len(client.tokenizer)], [-1, 5]):
        with pytest.raises(RequestValidationError) as refused:
            async for _ in client.generate(ids, params, f"bad-{ids[0]}"):
                pass
        assert refused.value.param == "prompt"
        assert f"bad-{ids[0]}" not in client.placements
    last = len(client.tokenizer) - 1
    outputs = [output async for output in client.generate([0, last], params, "edges")]
    assert outputs[-1].finished and outputs[-1].error is None
    await served.wait_until_idle()


async def test_a_request_the_wire_cannot_carry_leaves_nothing_tracked(served: ServedStack) -> None:
    """A seed past 64 bits fails to encode: the caller gets the error, the client forgets the
    request (its id is free again) and the engine stays idle."""
    client = served.stack.client
    with pytest.raises(OverflowError):
        async for _ in client.generate([5, 6], SamplingParams(max_tokens=2, seed=2**64), "huge"):
            pass
    assert "huge" not in client.placements and client.placements.engine_of("huge") is None
    outputs = [
        output async for output in client.generate([5, 6], SamplingParams(max_tokens=2), "huge")
    ]
    assert outputs[-1].finished and outputs[-1].error is None
    await served.wait_until_idle()
