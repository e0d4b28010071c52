"""The gateway's NATS API from a separate nats-py client on a real nats-server (and through the
in-memory bus): JSON and msgpack, whole and streamed answers, errors, queue groups, cancel."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest

from shoal.bus.errors import RemoteError
from shoal.bus.streams import request_stream
from shoal.bus.subjects import Subjects
from shoal.bus.transport.memory import InMemoryBroker, InMemoryBus
from shoal.bus.transport.nats_bus import NatsBus
from shoal.gateway.nats_api import NatsApi
from shoal.gateway.serving import serving_context
from tests.unit.test_gateway_fake import FakeEngineClient

pytestmark = [pytest.mark.timeout(120), pytest.mark.nats]
TIMEOUT = 20.0


class Gateway:
    def __init__(self, api: NatsApi, engine: FakeEngineClient) -> None:
        self.api, self.engine, self.subjects = api, engine, api.subjects


async def _start_gateways(url: str, count: int = 1, **engine_options: Any) -> list[Gateway]:
    subjects = Subjects(f"t{uuid.uuid4().hex[:10]}")
    gateways = []
    for _ in range(count):
        bus = NatsBus([url])
        await bus.connect()
        engine = FakeEngineClient(**engine_options)
        api = NatsApi(bus, serving_context(engine), subjects=subjects)
        await api.start()
        gateways.append(Gateway(api, engine))
    return gateways


async def _stop(gateways: list[Gateway]) -> None:
    for gateway in gateways:
        await gateway.api.stop()
        await gateway.api.bus.close()


@pytest.fixture
async def one_gateway(nats_url: str) -> AsyncIterator[Gateway]:
    gateways = await _start_gateways(nats_url)
    yield gateways[0]
    await _stop(gateways)


@pytest.fixture
async def client(nats_url: str) -> AsyncIterator[nats.NATS]:
    nc = await nats.connect(nats_url)
    yield nc
    await nc.close()


async def _stream(nc: nats.NATS, subject: str, payload: bytes, headers=None) -> list[Any]:  # type: ignore[no-untyped-def]
    """Publish with an inbox and read replies until a final or error message."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(subject, payload, reply=inbox, headers=headers)
    messages = []
    try:
        for _ in range(10_000):
            msg = await sub.next_msg(timeout=TIMEOUT)
            messages.append(msg)
            if msg.headers and msg.headers.get("Shoal-Stream") in ("last", "error"):
                break
    finally:
        await sub.unsubscribe()
    return messages


async def test_json_and_msgpack_answers_match_streamed_text(one_gateway: Gateway, client) -> None:  # type: ignore[no-untyped-def]
    subject = one_gateway.subjects.api_generate()
    request = {"prompt": "the quick fox", "sampling_params": {"max_tokens": 7, "n": 2}}
    reply = await client.request(subject, json.dumps(request).encode(), timeout=TIMEOUT)
    result = json.loads(reply.data)
    packed = await client.request(subject, msgspec.msgpack.encode(request), timeout=TIMEOUT)
    unpacked = msgspec.msgpack.decode(packed.data)
    assert unpacked.pop("request_id") != result.pop("request_id")  # fresh ids when none is given
    assert unpacked == result
    assert result["type"] == "result" and len(result["choices"]) == 2
    assert [c["finish_reason"] for c in result["choices"]] == ["length", "length"]
    prompt_len = len(one_gateway.engine.tokenizer.encode("the quick fox"))
    assert result["usage"] == {
        "prompt_tokens": prompt_len,
        "completion_tokens": 14,
        "total_tokens": prompt_len + 14,
    }

    streamed = await _stream(client, subject, json.dumps({**request, "stream": True}).encode())
    bodies = [json.loads(m.data) for m in streamed]
    assert [b["type"] for b in bodies[:-1]] == ["chunk"] * (len(bodies) - 1)
    assert bodies[-1]["type"] == "final" and bodies[-1]["usage"] == result["usage"]
    assert [m.headers["Shoal-Stream"] for m in streamed] == ["more"] * (len(bodies) - 1) + ["last"]
    for index in range(2):
        deltas = [c for b in bodies[:-1] for c in b["choices"] if c["index"] == index]
        assert "".join(c["text"] for c in deltas) == result["choices"][index]["text"]
        assert sum(len(c["token_ids"]) for c in deltas) == 7
        assert [c.get("finish_reason") for c in deltas if c.get("finish_reason")] == ["length"]
        assert deltas[-1]["finish_reason"] == "length"


async def test_token_ids_chat_and_logprobs(one_gateway: Gateway, client) -> None:  # type: ignore[no-untyped-def]
    subject = one_gateway.subjects.api_generate()
    ids = one_gateway.engine.tokenizer.encode("the lazy dog")
    by_text = {"prompt": "the lazy dog", "sampling_params": {"max_tokens": 4, "logprobs": 2}}
    by_ids = {"prompt_token_ids": ids, "sampling_params": {"max_tokens": 4, "logprobs": 2}}
    first = msgspec.msgpack.decode(
        (await client.request(subject, msgspec.msgpack.encode(by_text), timeout=TIMEOUT)).data
    )
    second = msgspec.msgpack.decode(
        (await client.request(subject, msgspec.msgpack.encode(by_ids), timeout=TIMEOUT)).data
    )
    assert first["choices"] == second["choices"]
    logprobs = first["choices"][0]["logprobs"]
    assert len(logprobs) == 4 and all(len(p) == 2 for p in logprobs)
    chat = {"messages": [{"role": "user", "content": "hi"}], "sampling_params": {"max_tokens": 3}}
    reply = json.loads(
        (await client.request(subject, json.dumps(chat).encode(), timeout=TIMEOUT)).data
    )
    assert reply["type"] == "result" and len(reply["choices"][0]["token_ids"]) == 3


BAD_REQUESTS: list[tuple[bytes, dict[str, str] | None, str, int, bool]] = [
    (b'{"prompt": ', None, "invalid_json", 400, True),
    (b"\x81\xa6prompt", None, "invalid_msgpack", 400, False),  # truncated msgpack
    (b"", None, "invalid_msgpack", 400, False),
    (b"\xc1", None, "invalid_msgpack", 400, False),
    (b'{"prompt": 3}', None, "invalid_type", 400, True),
    (b'{"prompt": "hi", "max_tokens": 3}', None, "invalid_value", 400, True),  # unknown field
    (b'{"prompt": "hi", "sampling_params": {"temperature": -1}}', None, "invalid_value", 400, True),
    (b'{"prompt": "hi", "prompt_token_ids": [1]}', None, "invalid_value", 400, True),
    (b'{"sampling_params": {}}', None, "invalid_value", 400, True),
    (b'{"prompt_token_ids": [99999]}', None, "invalid_value", 400, True),
    (b'{"prompt": "hi", "sampling_params": {"n": 129}}', None, "invalid_value", 400, True),
    # Integers msgpack cannot carry to the engine core (it would fail there, as a 503).
    (
        b'{"prompt": "hi", "sampling_params": {"seed": 18446744073709551616}}',
        None,
        "invalid_value",
        400,
        True,
    ),
    (
        b'{"prompt": "hi", "sampling_params": {"stop_token_ids": [18446744073709551616]}}',
        None,
        "invalid_value",
        400,
        True,
    ),
    (json.dumps({"prompt": "dog " * 300}).encode(), None, "context_length_exceeded", 400, True),
    (b'{"prompt": "hi", "model": "other"}', None, "model_not_found", 404, True),
    (b'{"prompt": "hi"}', {"Content-Type": "application/msgpack"}, "invalid_type", 400, False),
]


@pytest.mark.parametrize("stream", [False, True])
async def test_malformed_payloads_get_error_replies(
    one_gateway: Gateway, client, stream: bool
) -> None:  # type: ignore[no-untyped-def]
    subject = one_gateway.subjects.api_generate()
    for payload, headers, code, status, is_json in BAD_REQUESTS:
        if stream and is_json and payload.startswith(b'{"prompt": "hi"'):
            payload = payload[:-1] + b', "stream": true}'
        messages = await _stream(client, subject, payload, headers)
        assert len(messages) == 1, payload
        msg = messages[0]
        assert msg.headers["Shoal-Stream"] == "error" and msg.headers["Shoal-Error"] == code, (
            payload
        )
        body = json.loads(msg.data) if is_json else msgspec.msgpack.decode(msg.data)
        assert body["type"] == "error" and body["status"] == status
        assert body["error"]["code"] == code and body["error"]["message"]
    good = await client.request(subject, b'{"prompt": "hi"}', timeout=TIMEOUT)
    assert json.loads(good.data)["type"] == "result"
    assert not one_gateway.engine.in_flight


async def test_unready_engine_is_a_503_error(one_gateway: Gateway, client) -> None:  # type: ignore[no-untyped-def]
    one_gateway.engine.ready = False
    reply = await client.request(
        one_gateway.subjects.api_generate(), b'{"prompt": "hi"}', timeout=TIMEOUT
    )
    body = json.loads(reply.data)
    assert body["status"] == 503 and body["error"]["code"] == "engine_unavailable"


async def test_queue_group_shares_requests_between_gateways(nats_url: str, client) -> None:  # type: ignore[no-untyped-def]
    gateways = await _start_gateways(nats_url, count=2)
    try:
        subject = gateways[0].subjects.api_generate()
        replies = await asyncio.gather(
            *(
                client.request(
                    subject, json.dumps({"prompt": f"fox {i}"}).encode(), timeout=TIMEOUT
                )
                for i in range(24)
            )
        )
        assert all(json.loads(r.data)["type"] == "result" for r in replies)
        counts = [len(g.engine.requests) for g in gateways]
        assert sum(counts) == 24 and min(counts) > 0  # each once; both took some
    finally:
        await _stop(gateways)


async def test_cancel_stops_a_streamed_request(nats_url: str, client) -> None:  # type: ignore[no-untyped-def]
    gateways = await _start_gateways(nats_url, token_delay=0.01)
    gateway = gateways[0]
    try:
        inbox = client.new_inbox()
        sub = await client.subscribe(inbox)
        request = {
            "prompt": "hi",
            "stream": True,
            "request_id": "job-1",
            "sampling_params": {"max_tokens": 500},
        }
        await client.publish(
            gateway.subjects.api_generate(), json.dumps(request).encode(), reply=inbox
        )
        first = await sub.next_msg(timeout=TIMEOUT)
        assert first.headers["Shoal-Stream"] == "more"
        await client.publish(gateway.subjects.api("cancel"), b'{"request_id": "job-1"}')
        for _ in range(1000):
            last = await sub.next_msg(timeout=TIMEOUT)
            if last.headers["Shoal-Stream"] != "more":
                break
        assert last.headers["Shoal-Error"] == "cancelled"
        await sub.unsubscribe()
        assert gateway.engine.aborted == ["job-1-0"] and not gateway.engine.in_flight
    finally:
        await _stop(gateways)


@pytest.mark.parametrize("bus_kind", ["nats", "memory"])
async def test_stopping_the_api_tells_running_callers_before_the_bus_closes(
    nats_url: str, bus_kind: str
) -> None:
    if bus_kind == "nats":
        server_bus: Any = NatsBus([nats_url])
        client_bus: Any = NatsBus([nats_url])
    else:
        broker = InMemoryBroker()
        server_bus, client_bus = InMemoryBus(broker), InMemoryBus(broker)
    await server_bus.connect()
    await client_bus.connect()
    api = NatsApi(server_bus, serving_context(FakeEngineClient(token_delay=0.01)))
    await api.start()
    request = {"prompt": "hi", "stream": True, "sampling_params": {"max_tokens": 500}}
    stream = request_stream(
        client_bus, api.subjects.api_generate(), json.dumps(request).encode(), timeout=TIMEOUT
    )
    try:
        with pytest.raises(RemoteError) as caught:
            async for _ in stream:
                if api.running:  # streaming: stop the gateway as its owner would
                    await api.stop()
                    await server_bus.close()
        assert caught.value.code == "cancelled"
    finally:
        await stream.aclose()
        await client_bus.close()
        await server_bus.close()


async def test_in_memory_bus_request_stream() -> None:
    broker = InMemoryBroker()
    server_bus, client_bus = InMemoryBus(broker), InMemoryBus(broker)
    await server_bus.connect()
    await client_bus.connect()
    engine = FakeEngineClient()
    api = NatsApi(server_bus, serving_context(engine))
    await api.start()
    try:
        subject = api.subjects.api_generate()
        payload = msgspec.msgpack.encode({"prompt": "hi", "stream": True})
        bodies = [
            msgspec.msgpack.decode(m.data)
            async for m in request_stream(client_bus, subject, payload, timeout=TIMEOUT)
        ]
        assert bodies[-1]["type"] == "final" and bodies[-1]["usage"]["completion_tokens"] == 16
        assert sum(len(c["token_ids"]) for b in bodies[:-1] for c in b["choices"]) == 16
        with pytest.raises(RemoteError) as caught:
            async for _ in request_stream(client_bus, subject, b'{"prompt": ', timeout=TIMEOUT):
                pass
        assert caught.value.code == "invalid_json"
    finally:
        await api.stop()
        await client_bus.close()
        await server_bus.close()


async def test_docs_example_runs(nats_url: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The nats-py example of docs/nats-api.md, run as its own process against a gateway."""
    doc = (Path(__file__).parents[2] / "docs" / "nats-api.md").read_text()
    script = doc.split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "generate.py").write_text(script)
    gateways = await _start_gateways(nats_url)
    namespace = gateways[0].subjects.namespace
    env = {**os.environ, "NATS_URL": nats_url, "SHOAL_NAMESPACE": namespace}
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            str(tmp_path / "generate.py"),
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
    finally:
        await _stop(gateways)
    assert process.returncode == 0, stderr.decode()
    lines = stdout.decode().splitlines()
    assert lines[0].startswith("result: ") and lines[1].startswith("streamed: ")
    assert lines[0].removeprefix("result: ") == lines[1].removeprefix("streamed: ")
