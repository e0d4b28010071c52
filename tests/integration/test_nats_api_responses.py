"""The NATS API's Responses and Messages operations over the real engine stack (tiny random Llama
with a chat template), on the in-memory bus and on a real nats-server: the same answers as the
HTTP API for the same body (greedy text equal), every reply and streamed event valid against
the published schema, one message per event with the closing event marked last, stored
responses fetched and continued, and bad input answered by an error message with the server
unharmed."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anthropic
import msgspec
import openai
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.responses import Response, ResponseStreamEvent

from shoal.bus import connect_bus
from shoal.bus.base import STREAM_HEADER, STREAM_LAST, Bus
from shoal.bus.errors import RemoteError
from shoal.bus.streams import request_stream
from shoal.bus.subjects import Subjects
from shoal.gateway.nats_api import NatsApi
from shoal.gateway.response_store import ResponseStore
from shoal.gateway.serving import serving_context
from tests.fixtures.api_schemas import check_schema
from tests.integration.served_stack import (
    MODEL_NAME,
    ServedStack,
    served_stack,
    with_chat_template,
)

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
TIMEOUT = 60.0
SYSTEM = "be terse"
TEXT = "the quick brown fox"


@dataclass
class Api:
    served: ServedStack
    bus: Bus  # the caller's
    subjects: Subjects

    async def ask(self, op: str, body: dict[str, Any], *, packed: bool = False) -> list[Any]:
        """Every reply message of one request (decoded), checking the last is marked so."""
        payload = msgspec.msgpack.encode(body) if packed else json.dumps(body).encode()
        replies, last = [], None
        stream = request_stream(self.bus, self.subjects.api(op), payload, timeout=TIMEOUT)
        async for msg in stream:
            replies.append(msgspec.msgpack.decode(msg.data) if packed else json.loads(msg.data))
            last = msg.header(STREAM_HEADER)
        assert last == STREAM_LAST
        return replies

    async def error_of(self, op: str, payload: bytes) -> RemoteError:
        with pytest.raises(RemoteError) as caught:
            async for _ in request_stream(self.bus, self.subjects.api(op), payload, timeout=30):
                pass
        return caught.value


@pytest.fixture(params=["memory", pytest.param("nats", marks=pytest.mark.nats)])
async def api(request, tiny_checkpoint, tmp_path) -> AsyncIterator[Api]:  # type: ignore[no-untyped-def]
    model_dir = with_chat_template(tiny_checkpoint("llama"), tmp_path / "model")
    subjects = Subjects(f"natsresp{uuid.uuid4().hex[:8]}")
    async with served_stack(model_dir) as served:
        buses: list[Bus] = []
        if request.param == "nats":
            url = request.getfixturevalue("nats_server").url
            buses = [await connect_bus(url), await connect_bus(url)]
            server_bus, client_bus = buses
        else:
            server_bus = client_bus = served.stack.client.bus
        bucket = subjects.responses_bucket()
        ctx = serving_context(
            served.stack.client,
            served_model_name=MODEL_NAME,
            responses=ResponseStore(lambda: server_bus.open_kv(bucket)),
        )
        nats_api = NatsApi(server_bus, ctx, subjects=subjects)
        await nats_api.start()
        try:
            yield Api(served, client_bus, subjects)
        finally:
            await nats_api.stop()
            for bus in buses:
                await bus.close()
        await served.wait_until_idle()


async def test_responses_whole_streamed_fetched_and_continued(api: Api) -> None:
    body = {
        "model": MODEL_NAME, "input": TEXT, "instructions": SYSTEM,
        "max_output_tokens": 12, "temperature": 0,
    }  # fmt: skip
    http = openai.AsyncOpenAI(base_url=f"{api.served.url}/v1", api_key="x", max_retries=0)
    expected = await http.responses.create(**body)
    (whole,) = await api.ask("responses", body)
    response = check_schema(Response, whole)
    assert response.output_text == expected.output_text and response.id.startswith("resp_")
    assert response.usage is not None and expected.usage is not None
    assert response.usage.output_tokens == expected.usage.output_tokens

    events = [
        check_schema(ResponseStreamEvent, e)
        for e in await api.ask("responses", {**body, "stream": True})
    ]
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == expected.output_text

    (fetched,) = await api.ask("responses_get", {"response_id": response.id}, packed=True)
    assert check_schema(Response, fetched).output_text == response.output_text
    follow_up = {**body, "input": "and then?", "previous_response_id": response.id}
    (continued,) = await api.ask("responses", follow_up)
    chat = await http.chat.completions.create(
        model=MODEL_NAME, max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": TEXT},
                  {"role": "assistant", "content": response.output_text},
                  {"role": "user", "content": "and then?"}],
    )  # fmt: skip
    assert check_schema(Response, continued).output_text == chat.choices[0].message.content


async def test_messages_whole_and_streamed(api: Api) -> None:
    body = {
        "model": MODEL_NAME, "max_tokens": 12, "system": SYSTEM, "temperature": 0,
        "messages": [{"role": "user", "content": TEXT}],
    }  # fmt: skip
    claude = anthropic.AsyncAnthropic(base_url=api.served.url, api_key="x", max_retries=0)
    sdk_body = {k: v for k, v in body.items() if k != "temperature"}  # the SDK lacks it
    expected = await claude.messages.create(**sdk_body, extra_body={"temperature": 0})
    (whole,) = await api.ask("messages", body, packed=True)
    message = check_schema(Message, whole)
    assert [b.model_dump() for b in message.content] == [b.model_dump() for b in expected.content]
    assert message.stop_reason == expected.stop_reason
    events = [
        check_schema(RawMessageStreamEvent, e)
        for e in await api.ask("messages", {**body, "stream": True})
    ]
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    text = "".join(
        e.delta.text
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "text_delta"
    )
    assert text == expected.content[0].text  # type: ignore[union-attr]


async def test_bad_input_is_an_error_message_and_harmless(api: Api) -> None:
    missing = await api.error_of("responses_get", b'{"response_id": "resp_0123abc"}')
    assert missing.code == "not_found"
    no_max = json.dumps({"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}]})
    assert (await api.error_of("messages", no_max.encode())).code == "missing_required_parameter"
    assert (await api.error_of("responses", b'{"input": 5}')).code == "invalid_type"
    assert (await api.error_of("responses", b"{not json")).code == "invalid_json"
    wrong_model = {"model": "nope", "input": "x"}
    assert (
        await api.error_of("responses", json.dumps(wrong_model).encode())
    ).code == "model_not_found"
    (answer,) = await api.ask(
        "responses", {"model": MODEL_NAME, "input": TEXT, "max_output_tokens": 3}
    )
    assert answer["status"] in ("completed", "incomplete")
