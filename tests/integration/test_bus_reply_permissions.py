"""Replies and chunked transfers under ``bus.nats_ops.permissions`` on a real nats-server whose
small max_payload makes every large message travel chunked: a reply forged into another user's
request in flight is refused (the requester gets the real one), an actor answers a request once, no
role sees another's chunk pulls, and the ``client`` role sends a chunked request to the NATS API
and gets chunked and streamed answers from a deployment of the tiny model, with no refusal."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from shoal.bus.msg import Msg
from shoal.bus.nats_ops.permissions import ROLES, authorization_config, user_name
from shoal.bus.nats_ops.server import NatsServer, NatsServerNotFoundError
from shoal.bus.streams import request_stream
from shoal.bus.subjects import Subjects
from shoal.bus.transport.nats_bus import NatsBus
from shoal.config.deployment import ShoalConfig
from tests.fixtures.nats import nats_server_missing
from tests.integration.conditions import wait_for
from tests.integration.role_buses import role_buses, role_deployment

pytestmark = [pytest.mark.timeout(240), pytest.mark.nats]
NS = "rperm"
S = Subjects(NS)
MAX_PAYLOAD = 9 * 1024  # NatsBus leaves 8 KiB for headers: anything above 1 KiB is chunked
WAIT_S = 30.0
STEP = S.worker_in("worker-0-0")


@pytest.fixture(scope="module")
def auth_server() -> Iterator[tuple[NatsServer, dict[str, str]]]:
    passwords = {role: secrets.token_urlsafe(18) for role in ROLES}
    try:
        config = authorization_config(NS, passwords)
        server = NatsServer(max_payload=MAX_PAYLOAD, extra_config=config)
    except NatsServerNotFoundError as exc:
        nats_server_missing(exc)
    with server:
        yield server, passwords


@pytest.fixture
async def connect_as(auth_server) -> AsyncIterator[Callable[[str], Awaitable[NatsBus]]]:  # type: ignore[no-untyped-def]
    server, passwords = auth_server
    async with role_buses(server.url, NS, passwords) as connect:
        yield connect


async def _held_request(connect_as, data: bytes = b"step"):  # type: ignore[no-untyped-def]
    """An engine core's request to a worker, in flight: (engine, worker, the request as the
    worker got it, the engine's task awaiting the reply)."""
    engine, worker = await connect_as("engine"), await connect_as("worker")
    asked: asyncio.Queue[Msg] = asyncio.Queue()

    async def hold(msg: Msg) -> None:
        asked.put_nowait(msg)

    await worker.subscribe(STEP, hold)
    await worker.flush()
    pending = asyncio.create_task(engine.request(STEP, data, timeout=WAIT_S))
    msg = await asyncio.wait_for(asked.get(), WAIT_S)
    return engine, worker, msg, pending


# "worker": another worker process (the same user), which was not asked.
@pytest.mark.parametrize("forger", ["worker", "tier", "gateway", "recovery", "client"])
async def test_a_reply_forged_into_a_request_in_flight_is_refused(connect_as, forger: str):  # type: ignore[no-untyped-def]
    engine, worker, msg, pending = await _held_request(connect_as)
    assert msg.reply and msg.reply.startswith(S.inbox_prefix(engine.user or "") + ".")
    bad = await connect_as(forger)
    await bad.publish(msg.reply, b"forged")
    await bad.flush()
    await wait_for(lambda: bad.num_permission_violations == 1, WAIT_S, "refusal")
    assert msg.reply.lower() in bad.permission_violations[-1]  # nats-py lowercases it
    assert not pending.done()  # the forged reply never reached the engine core
    await msg.respond(b"real")
    assert (await pending).data == b"real"
    assert worker.num_permission_violations == engine.num_permission_violations == 0


async def test_an_actor_answers_a_request_once(connect_as):  # type: ignore[no-untyped-def]
    engine, worker, msg, pending = await _held_request(connect_as)
    await msg.respond(b"real")
    assert (await pending).data == b"real"
    await msg.respond(b"again")  # allow_responses max 1
    await worker.flush()
    await wait_for(lambda: worker.num_permission_violations == 1, WAIT_S, "refusal")
    assert engine.num_permission_violations == 0


async def test_no_role_sees_another_roles_chunk_pulls(connect_as):  # type: ignore[no-untyped-def]
    spy = await connect_as("tier")
    pulls: list[str] = []

    async def seen(msg: Msg) -> None:
        pulls.append(msg.subject)

    for subject in (S.transfers(), S.transfer_prefix(user_name(NS, "engine")) + ".>"):
        await spy.subscribe(subject, seen)
    await spy.flush()
    await wait_for(lambda: spy.num_permission_violations == 2, WAIT_S, "refusals")
    big = secrets.token_bytes(5000)
    engine, worker, msg, pending = await _held_request(connect_as, big)  # pulled from the engine
    assert msg.data == big
    await msg.respond(big[::-1])  # the engine core pulls it from the worker
    assert (await pending).data == big[::-1]
    await spy.flush()
    assert pulls == []
    assert worker.num_permission_violations == engine.num_permission_violations == 0


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint) -> Path:  # type: ignore[no-untyped-def]
    return tiny_checkpoint("llama")


async def test_the_client_role_sends_and_gets_chunked_messages_through_the_nats_api(
    connect_as, model_dir, hf_reference
):  # type: ignore[no-untyped-def]
    config = ShoalConfig.from_options(
        model=str(model_dir),
        dtype="float32",
        namespace=NS,
        num_gpu_blocks_override=64,
        block_size=16,
    )
    async with role_deployment(connect_as, config, WAIT_S * 2) as deployed:
        caller = deployed.buses["client"] = await connect_as("client")
        await _ask_chunked(caller, deployed.gateway_bus, model_dir, hf_reference)
    assert deployed.violations() == {}


async def _ask_chunked(caller: NatsBus, gateway_bus: NatsBus, model_dir, hf_reference) -> None:  # type: ignore[no-untyped-def]
    prompt = [(7 * i + 3) % 200 + 5 for i in range(600)]
    params = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 5}
    request = json.dumps({"prompt_token_ids": prompt, "sampling_params": params}).encode()
    assert caller._chunks is not None and len(request) > caller._chunks.chunk_size  # chunked
    reply = await caller.request(S.api_generate(), request, timeout=WAIT_S * 2)
    assert gateway_bus._chunks is not None and len(reply.data) > gateway_bus._chunks.chunk_size
    answer = json.loads(reply.data)
    assert answer["type"] == "result", answer
    expected = hf_reference(model_dir, [prompt], params["max_tokens"])[0]
    assert answer["choices"][0]["token_ids"] == expected
    streamed = json.dumps({"prompt_token_ids": prompt, "sampling_params": params, "stream": True})
    messages = [
        json.loads(m.data)
        async for m in request_stream(
            caller, S.api_generate(), streamed.encode(), timeout=WAIT_S * 2
        )
    ]
    assert len(messages) > 2 and messages[-1]["type"] == "final"  # many answers to one request
    tokens = [t for m in messages[:-1] for c in m["choices"] for t in c["token_ids"]]
    assert tokens == expected
