"""OpenAI's Responses API over the real engine stack (tiny random Llama with a chat template,
in-memory bus), driven by the official ``openai`` SDK's ``responses.create`` with unchanged
client code: plain (greedy text equal to chat completions' for the same conversation),
streamed (the typed events in order, deltas joining to the text), a function tool forced, a
JSON-schema format, and a conversation continued by ``previous_response_id`` through a second
gateway that shares only the deployment's key-value bucket; ``GET`` and cancel; bad input."""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from openai.types.shared import ErrorObject

from shoal.bus.subjects import Subjects
from shoal.gateway.app import create_app
from shoal.gateway.response_store import ResponseStore
from shoal.gateway.server import start_http_server
from tests.fixtures.api_schemas import check_schema, sse_events
from tests.integration.served_stack import MODEL_NAME, served_stack, with_chat_template

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "the weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    },
}


def store_on(bus) -> ResponseStore:  # type: ignore[no-untyped-def]
    return ResponseStore(lambda: bus.open_kv(Subjects().responses_bucket()))


@pytest.fixture
async def served(tiny_checkpoint, tmp_path):  # type: ignore[no-untyped-def]
    model_dir = with_chat_template(tiny_checkpoint("llama"), tmp_path / "model")
    async with served_stack(model_dir) as stack:
        yield stack


async def test_responses_create_whole_and_streamed_equal_chat(served) -> None:  # type: ignore[no-untyped-def]
    client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0)
    response = await client.responses.create(
        model=MODEL_NAME, input="the quick brown fox", instructions="be terse",
        max_output_tokens=12, temperature=0,
    )  # fmt: skip
    chat = await client.chat.completions.create(
        model=MODEL_NAME, max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": "be terse"},
                  {"role": "user", "content": "the quick brown fox"}],
    )  # fmt: skip
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    length = chat.choices[0].finish_reason == "length"
    assert response.status == ("incomplete" if length else "completed")
    events = [
        e
        async for e in await client.responses.create(
            model=MODEL_NAME,
            input="the quick brown fox",
            instructions="be terse",
            max_output_tokens=12,
            temperature=0,
            stream=True,
        )
    ]
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == response.output_text == events[-1].response.output_text
    await served.wait_until_idle()


async def test_a_forced_function_call_and_a_json_schema_format(served) -> None:  # type: ignore[no-untyped-def]
    client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0)
    forced = {"type": "function", "name": "get_weather"}
    called = await client.responses.create(
        model=MODEL_NAME, input="weather?", tools=[WEATHER], tool_choice=forced,
        max_output_tokens=80, temperature=0,
    )  # fmt: skip
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    streamed = [
        e
        async for e in await client.responses.create(
            model=MODEL_NAME,
            input="weather?",
            tools=[WEATHER],
            stream=True,
            temperature=0,
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=80,
        )
    ]
    arguments = "".join(
        e.delta for e in streamed if e.type == "response.function_call_arguments.delta"
    )
    assert arguments == call.arguments
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    formatted = await client.responses.create(
        model=MODEL_NAME, input="a number", max_output_tokens=40, temperature=0,
        text={"format": {"type": "json_schema", "name": "num", "schema": schema}},
    )  # fmt: skip
    assert isinstance(json.loads(formatted.output_text)["n"], int)
    await served.wait_until_idle()


async def test_a_conversation_continues_through_another_gateway(served) -> None:  # type: ignore[no-untyped-def]
    bus = served.stack.client.bus
    first_app = create_app(
        served.stack.client, served_model_name=MODEL_NAME, responses=store_on(bus)
    )
    second_app = create_app(
        served.stack.client, served_model_name=MODEL_NAME, responses=store_on(bus)
    )
    first, second = await start_http_server(first_app), await start_http_server(second_app)
    try:
        one = openai.AsyncOpenAI(base_url=f"{first.url}/v1", api_key="x", max_retries=0)
        two = openai.AsyncOpenAI(base_url=f"{second.url}/v1", api_key="x", max_retries=0)
        opening = await one.responses.create(
            model=MODEL_NAME, input="the quick brown fox", max_output_tokens=8, temperature=0
        )
        continued = await two.responses.create(
            model=MODEL_NAME, input="and then?", previous_response_id=opening.id,
            max_output_tokens=8, temperature=0,
        )  # fmt: skip
        whole = await two.chat.completions.create(
            model=MODEL_NAME, max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": "the quick brown fox"},
                      {"role": "assistant", "content": opening.output_text},
                      {"role": "user", "content": "and then?"}],
        )  # fmt: skip
        assert continued.output_text == whole.choices[0].message.content
        assert continued.previous_response_id == opening.id
        fetched = await two.responses.retrieve(opening.id)
        assert fetched.output_text == opening.output_text
        with pytest.raises(openai.NotFoundError):
            await two.responses.create(
                model=MODEL_NAME, input="x", previous_response_id="resp_missing"
            )
        with pytest.raises(openai.BadRequestError, match="background"):
            await two.responses.cancel(opening.id)
        with pytest.raises(openai.BadRequestError):
            await two.responses.create(
                model=MODEL_NAME, input=[{"role": "user", "content": [{"type": "input_image"}]}]
            )
    finally:
        await first.stop()
        await second.stop()
    await served.wait_until_idle()


async def test_every_body_and_event_matches_the_published_schema(served) -> None:  # type: ignore[no-untyped-def]
    """Raw bodies and server-sent events (not the SDK's lenient parse) validated against the
    published types: plain, a forced function call, a JSON-schema format, each whole and
    streamed; a fetched response; an error."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    bodies = [
        {"input": "the quick brown fox", "instructions": "be terse", "max_output_tokens": 12},
        {"input": "weather?", "tools": [WEATHER], "max_output_tokens": 80,
         "tool_choice": {"type": "function", "name": "get_weather"}},
        {"input": "a number", "max_output_tokens": 40,
         "text": {"format": {"type": "json_schema", "name": "num", "schema": schema}}},
    ]  # fmt: skip
    async with aiohttp.ClientSession() as session:
        for body in bodies:
            body = {"model": MODEL_NAME, "temperature": 0, **body}
            async with session.post(f"{served.url}/v1/responses", json=body) as answer:
                response = check_schema(Response, await answer.json())
            async with session.post(
                f"{served.url}/v1/responses", json={**body, "stream": True}
            ) as answer:
                events = sse_events(await answer.text())
            for event in events:
                check_schema(ResponseStreamEvent, event)
            assert events[-1]["type"] in ("response.completed", "response.incomplete")
            closing = events[-1]["response"]
            assert [item["type"] for item in closing["output"]] == [o.type for o in response.output]
        async with session.get(f"{served.url}/v1/responses/{response.id}") as answer:
            check_schema(Response, await answer.json())
        async with session.post(
            f"{served.url}/v1/responses", json={"model": "nope", "input": "x"}
        ) as answer:
            assert answer.status == 404
            check_schema(ErrorObject, (await answer.json())["error"])
    await served.wait_until_idle()
