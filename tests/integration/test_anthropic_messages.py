"""Anthropic's Messages API (``POST /v1/messages``) over the real engine stack (tiny random
Llama with a chat template, in-memory bus), driven by the official ``anthropic`` SDK with
unchanged client code: a message and its stream (the event sequence Anthropic documents, the
deltas joining to the same text), greedy text equal to chat completions' for the same
conversation, stop sequences, forced and named tool calls (whole and streamed), and errors in
Anthropic's shape with the server unharmed."""

from __future__ import annotations

import json

import aiohttp
import anthropic
import openai
import pytest
from anthropic.types import ErrorResponse, Message, RawMessageStreamEvent

from shoal.gateway.tools import ToolCallingOptions
from tests.fixtures.api_schemas import check_schema, sse_events
from tests.integration.served_stack import MODEL_NAME, served_stack, with_chat_template

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
SYSTEM = "you are terse"
# The current SDK no longer names Anthropic's sampling fields; the API still takes them.
GREEDY = {"temperature": 0}
MESSAGES = [{"role": "user", "content": "the quick brown fox"}]
WEATHER = {
    "name": "get_weather",
    "description": "the weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    },
}


@pytest.fixture
async def served(tiny_checkpoint, tmp_path):  # type: ignore[no-untyped-def]
    model_dir = with_chat_template(tiny_checkpoint("llama"), tmp_path / "model")
    async with served_stack(model_dir) as stack:
        yield stack


def clients(url: str) -> tuple[anthropic.AsyncAnthropic, openai.AsyncOpenAI]:
    return (
        anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0),
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0),
    )


async def test_a_message_and_its_stream_equal_chat_completions(served) -> None:  # type: ignore[no-untyped-def]
    claude, oai = clients(served.url)
    message = await claude.messages.create(
        model=MODEL_NAME, max_tokens=12, system=SYSTEM, messages=MESSAGES, extra_body=GREEDY
    )
    chat = await oai.chat.completions.create(
        model=MODEL_NAME, max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, *MESSAGES],
    )  # fmt: skip
    assert message.type == "message" and message.role == "assistant"
    assert message.model == MODEL_NAME and message.id.startswith("msg_")
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == chat.choices[0].message.content
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens
    expected_reason = {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert message.stop_reason == expected_reason

    kinds, texts = [], []
    async with claude.messages.stream(
        model=MODEL_NAME, max_tokens=12, system=SYSTEM, messages=MESSAGES, extra_body=GREEDY
    ) as stream:
        async for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta":
                texts.append(event.delta.text)
        final = await stream.get_final_message()
    raw = [k for k in kinds if k not in ("text",)]  # the SDK adds its own "text" events
    assert raw[0] == "message_start" and raw[1] == "content_block_start"
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "".join(texts) == message.content[0].text == final.content[0].text
    assert final.stop_reason == message.stop_reason
    assert final.usage.output_tokens == message.usage.output_tokens
    await served.wait_until_idle()


async def test_a_stop_sequence_ends_the_message_and_is_named(served) -> None:  # type: ignore[no-untyped-def]
    claude, _ = clients(served.url)
    whole = await claude.messages.create(
        model=MODEL_NAME, max_tokens=20, messages=MESSAGES, extra_body=GREEDY
    )
    text = whole.content[0].text
    assert len(text) > 4
    stop = text[2:4]
    cut = await claude.messages.create(
        model=MODEL_NAME, max_tokens=20, messages=MESSAGES, extra_body=GREEDY, stop_sequences=[stop]
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]
    await served.wait_until_idle()


@pytest.mark.parametrize(
    "choice",
    [{"type": "any", "disable_parallel_tool_use": True}, {"type": "tool", "name": "get_weather"}],
)
async def test_forced_tool_calls_whole_and_streamed(served, choice) -> None:  # type: ignore[no-untyped-def]
    claude, _ = clients(served.url)
    common = {
        "model": MODEL_NAME, "max_tokens": 120, "messages": MESSAGES, "extra_body": GREEDY,
        "tools": [WEATHER], "tool_choice": choice,
    }  # fmt: skip
    message = await claude.messages.create(**common)
    uses = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use" and len(uses) >= 1
    assert uses[0].name == "get_weather" and isinstance(uses[0].input["city"], str)
    partial = []
    async with claude.messages.stream(**common) as stream:
        async for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                partial.append(event.delta.partial_json)
        final = await stream.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in streamed] == [(b.name, b.input) for b in uses]
    if choice["type"] == "tool":  # a named call streams its arguments as one object
        assert json.loads("".join(partial)) == uses[0].input
    await served.wait_until_idle()


async def test_errors_are_anthropic_shaped_and_harmless(served) -> None:  # type: ignore[no-untyped-def]
    claude, _ = clients(served.url)
    with pytest.raises(anthropic.NotFoundError) as missing:
        await claude.messages.create(model="nope", max_tokens=4, messages=MESSAGES)
    assert missing.value.body["error"]["type"] == "not_found_error"
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    with pytest.raises(anthropic.BadRequestError, match="image content blocks"):
        await claude.messages.create(
            model=MODEL_NAME, max_tokens=4, messages=[{"role": "user", "content": [image]}]
        )
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{served.url}/v1/messages", json={"model": MODEL_NAME, "messages": MESSAGES}
        ) as response,
    ):  # no max_tokens
        body = await response.json()
    assert response.status == 400 and body["type"] == "error"
    assert (
        body["error"]["type"] == "invalid_request_error"
        and "max_tokens" in body["error"]["message"]
    )
    ok = await claude.messages.create(model=MODEL_NAME, max_tokens=4, messages=MESSAGES)
    assert ok.content[0].type == "text"
    await served.wait_until_idle()


# What hermes' format forces (a regex): some text, then two calls.
HERMES_CALLS = (
    'ok <tool_call>\\{"name": "get_weather", "arguments": \\{"city": "(Paris|Rome)"\\}\\}'
    '</tool_call>\n<tool_call>\\{"name": "get_time", "arguments": \\{"zone": "[A-Z]{3}"\\}\\}'
    "</tool_call>"
)
GET_TIME = {
    "name": "get_time",
    "input_schema": {"type": "object", "properties": {"zone": {"type": "string"}}},
}


async def test_auto_tool_choice_parses_calls_and_every_body_matches_the_schema(
    tiny_checkpoint, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """``tool_choice: auto`` with ``--enable-auto-tool-choice --tool-call-parser hermes``: the
    calls the model writes (a grammar makes it write two, after some text) become ``tool_use``
    blocks after the text, whole and streamed; every raw body and event, plain, forced, auto
    and an error, validates against the published types."""
    model_dir = with_chat_template(tiny_checkpoint("llama"), tmp_path / "model")
    options = {"tool_calling": ToolCallingOptions(True, "hermes")}
    async with served_stack(model_dir, app_options=options) as served:
        claude, _ = clients(served.url)
        auto = {
            "model": MODEL_NAME, "max_tokens": 400, "messages": MESSAGES,
            "tools": [WEATHER, GET_TIME], "tool_choice": {"type": "auto"},
            "extra_body": {**GREEDY, "structured_outputs": {"regex": HERMES_CALLS}},
        }  # fmt: skip
        message = await claude.messages.create(**auto)
        assert [b.type for b in message.content] == ["text", "tool_use", "tool_use"], message
        assert message.content[0].text == "ok "  # type: ignore[union-attr]
        uses = [(b.name, b.input) for b in message.content if b.type == "tool_use"]
        assert [name for name, _ in uses] == ["get_weather", "get_time"]
        assert uses[0][1]["city"] in ("Paris", "Rome") and message.stop_reason == "tool_use"
        async with claude.messages.stream(**auto) as stream:
            final = await stream.get_final_message()
        assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == uses
        forced = {**auto, "tool_choice": {"type": "any"}, "extra_body": GREEDY}
        async with aiohttp.ClientSession() as session:
            plain = {**auto, "tools": [], "tool_choice": {"type": "none"}, "extra_body": GREEDY}
            stopped = {**plain, "stop_sequences": [" ", "e"], "system": "be terse"}
            for body in (auto, forced, plain, stopped):
                raw = {k: v for k, v in body.items() if k != "extra_body"}
                raw.update(body["extra_body"])  # type: ignore[arg-type]
                url = f"{served.url}/v1/messages"
                async with session.post(url, json=raw) as answer:
                    check_schema(Message, await answer.json())
                async with session.post(url, json={**raw, "stream": True}) as answer:
                    for event in sse_events(await answer.text()):
                        check_schema(RawMessageStreamEvent, event)
            async with session.post(url, json={**raw, "model": "nope"}) as answer:
                assert answer.status == 404
                check_schema(ErrorResponse, await answer.json())
        await served.wait_until_idle()
