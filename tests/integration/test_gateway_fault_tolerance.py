"""vLLM's fault-tolerance endpoints through the real engine (worker, engine core and client
behind the gateway, one stack for the module): ``GET /fault_tolerance/status`` lists the engine
core healthy; ``POST /fault_tolerance/apply`` refuses an unknown instruction or a malformed body
with a 400 in the gateway's error shape, and answers ``retry`` with a 202 while the engine core's
rejection (it is healthy) shows in the status as ``ft_error``; both sit behind the API key."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from shoal.gateway.app import create_app
from shoal.gateway.server import start_http_server
from shoal.workers.actor import WorkerActor
from tests.integration.fault_tools import inject_engine_fault
from tests.integration.served_stack import ServedStack, complete, served_stack
from tests.unit.test_gateway_fake import FakeEngineClient

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

TIMEOUT = aiohttp.ClientTimeout(total=60)  # no request may hang
LIMIT_S = 30.0
FT_CONFIG = {"enable_request_resumption": False, "enable_recovery_controller": False}
FT_OPTIONS = {"fault_tolerance_config": FT_CONFIG}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tiny_checkpoint) -> AsyncIterator[ServedStack]:  # type: ignore[no-untyped-def]
    async with served_stack(tiny_checkpoint("llama"), **FT_OPTIONS) as stack:
        yield stack


@pytest_asyncio.fixture(loop_scope="module")
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as client_session:
        yield client_session


async def get_status(served: ServedStack, session: aiohttp.ClientSession) -> dict[str, Any]:
    async with session.get(served.url + "/fault_tolerance/status") as response:
        assert response.status == 200, await response.text()
        return dict(await response.json())


async def apply(
    served: ServedStack, session: aiohttp.ClientSession, body: bytes | dict[str, Any]
) -> tuple[int, dict[str, Any]]:
    url = served.url + "/fault_tolerance/apply"
    options: dict[str, Any] = {"data": body} if isinstance(body, bytes) else {"json": body}
    async with session.post(url, **options) as response:
        return response.status, dict(await response.json())


async def test_status_lists_the_engine_core_healthy(
    served: ServedStack, session: aiohttp.ClientSession
) -> None:
    assert await get_status(served, session) == {
        "schema_version": 1,
        "total_engines": 1,
        "engines": [{"id": "e0", "status": "healthy"}],
    }


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"instruction": "pause", "params": {}}, "invalid_value", "instruction"),
        ({"instruction": "RETRY"}, "invalid_value", "instruction"),
        (b'{"instruction": "retry"', "invalid_json", None),
        ({"params": {}}, "missing_required_parameter", "instruction"),
        ({"instruction": 7}, "invalid_type", "instruction"),
        ({"instruction": "retry", "params": []}, "invalid_type", "params"),
        ({"instruction": "retry", "engine": "e0"}, "invalid_value", None),
    ],
)
async def test_apply_refuses_an_unknown_instruction_or_a_malformed_body(
    served: ServedStack,
    session: aiohttp.ClientSession,
    body: bytes | dict[str, Any],
    code: str,
    param: str | None,
) -> None:
    status, answer = await apply(served, session, body)
    assert status == 400, answer
    error = answer["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", code, param)
    assert error["message"]
    assert "last_ft_request_id" not in (await get_status(served, session))["engines"][0]


async def test_retry_while_healthy_is_accepted_and_the_engine_rejection_recorded(
    served: ServedStack, session: aiohttp.ClientSession
) -> None:
    status, answer = await apply(served, session, {"instruction": "retry", "params": {}})
    assert status == 202, answer
    assert set(answer) == {"message", "request_id"}
    request_id = answer["request_id"]
    entry = await engine_status_until(
        served, session, lambda e: e.get("last_ft_request_id") == request_id
    )
    assert entry["status"] == "healthy"
    assert entry["ft_error"] == "[FT] Rejecting instruction 'retry': engine e0 is healthy"
    async with session.get(served.url + "/health") as response:
        assert response.status == 200


async def engine_status_until(
    served: ServedStack,
    session: aiohttp.ClientSession,
    predicate: Callable[[dict[str, Any]], bool],
    engine_id: str = "e0",
) -> dict[str, Any]:
    """Poll ``GET /fault_tolerance/status`` until ``engine_id``'s entry satisfies
    ``predicate``; that entry. AssertionError (with the last entry) after ``LIMIT_S``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + LIMIT_S
    while True:
        engines = (await get_status(served, session))["engines"]
        entry = next((dict(e) for e in engines if e["id"] == engine_id), {})
        if predicate(entry):
            return entry
        if loop.time() > deadline:
            raise AssertionError(f"status of {engine_id} not reached in {LIMIT_S} s: {entry}")
        await asyncio.sleep(0.05)


async def test_metrics_show_the_engine_core_healthy(
    served: ServedStack, session: aiohttp.ClientSession
) -> None:
    labels = {"model_name": "tiny", "engine": "e0"}
    registry = served.metrics.registry
    assert registry.get_sample_value("shoal:engine_status", labels) == 0
    assert registry.get_sample_value("shoal:engine_faults_total", labels) == 0
    async with session.get(served.url + "/metrics") as response:
        text = await response.text()
    assert 'shoal:engine_status{engine="e0",model_name="tiny"} 0.0' in text


async def test_fault_tolerance_endpoints_need_the_api_key() -> None:
    app = create_app(FakeEngineClient(), api_key="sesame")
    server = await start_http_server(app)
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as client:
            url = server.url + "/fault_tolerance/status"
            async with client.get(url) as response:
                assert response.status == 401
                assert (await response.json())["error"]["code"] == "invalid_api_key"
            url = server.url + "/fault_tolerance/apply"
            async with client.post(url, json={"instruction": "retry"}) as response:
                assert response.status == 401
            headers = {"Authorization": "Bearer sesame"}  # past the key: the fake has no FT API
            async with client.get(server.url + "/fault_tolerance/status", headers=headers) as r:
                assert r.status == 501
                assert (await r.json())["error"]["code"] == "not_supported"
    finally:
        await server.stop()


async def test_injected_fault_shows_unhealthy_and_retry_brings_the_engine_core_back(
    served: ServedStack, session: aiohttp.ClientSession
) -> None:
    """An injected fault → the engine core unhealthy with its fault, ``/health`` 503 (the only
    one), its request failed cleanly; ``retry`` → 202 → healthy again, the earlier rejection
    cleared, one fault and one recovery counted, and it serves."""
    client = served.stack.client
    await inject_engine_fault(client.bus, client.subjects, "e0")
    body = {"prompt": "the quick", "max_tokens": 8, "ignore_eos": True}
    async with session.post(served.url + "/v1/completions", json=body) as response:
        assert response.status == 503, await response.text()  # its step raised
        assert (await response.json())["error"]["code"] == "engine_error"
    entry = await engine_status_until(served, session, lambda e: e["status"] == "unhealthy")
    assert "injected fault" in entry["fault_info"]
    async with session.get(served.url + "/health") as response:
        assert response.status == 503
    assert _metric(served, "shoal:engine_status") == 2

    status, answer = await apply(served, session, {"instruction": "retry", "params": {}})
    assert status == 202, answer
    entry = await engine_status_until(served, session, lambda e: e["status"] == "healthy")
    assert entry == {"id": "e0", "status": "healthy"}  # no fault, no failed command
    async with session.get(served.url + "/health") as response:
        assert response.status == 200
    assert _metric(served, "shoal:engine_faults_total") == 1
    assert _metric(served, "shoal:engine_recoveries_total") == 1
    assert _metric(served, "shoal:engine_status") == 0
    assert (await complete(session, served.url, body)).finish_reason == "length"
    await served.wait_until_idle()


def _metric(served: ServedStack, name: str, engine_id: str = "e0") -> float | None:
    labels = {"model_name": "tiny", "engine": engine_id}
    return served.metrics.registry.get_sample_value(name, labels)


async def test_two_engine_cores_a_dead_worker_then_its_replacement_and_retry(
    tiny_checkpoint,  # type: ignore[no-untyped-def]
) -> None:
    """DP=2, w1 stopped: e1 dead with its fault while e0 serves (``/health`` 200); a ``retry``
    is rejected by both (healthy, dead) and recorded per engine core; once w1 is back, e1 is
    unhealthy by itself, and a ``retry`` brings it back healthy (its record cleared; e0's
    rejection recorded again): one fault and one recovery counted for e1, none for e0."""
    async with (
        served_stack(
            tiny_checkpoint("llama"), num_engines=2, worker_dead_after_s=1.0, **FT_OPTIONS
        ) as served,
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
    ):
        await served.stack.workers[1].stop("killed by the test")
        e1 = await engine_status_until(served, session, lambda e: e["status"] == "dead", "e1")
        assert "w1" in e1["fault_info"]
        assert (await get_status(served, session))["engines"][0]["status"] == "healthy"
        async with session.get(served.url + "/health") as response:
            assert response.status == 200  # e0 still serves

        first = await apply_retry(served, session)
        e1 = await engine_status_until(
            served, session, lambda e: e.get("last_ft_request_id") == first, "e1"
        )
        assert e1["ft_error"] == "[FT] Rejecting instruction 'retry': engine e1 is dead"
        e0 = await engine_status_until(
            served, session, lambda e: e.get("last_ft_request_id") == first
        )
        assert e0["ft_error"] == "[FT] Rejecting instruction 'retry': engine e0 is healthy"

        engine = served.stack.engines[1]
        replacement = WorkerActor(served.stack.client.bus, "w1", config=engine.config)
        await replacement.start()
        served.stack.workers[1] = replacement
        e1 = await engine_status_until(served, session, lambda e: e["status"] == "unhealthy", "e1")
        assert "w1" in e1["fault_info"]
        second = await apply_retry(served, session)
        e1 = await engine_status_until(served, session, lambda e: e["status"] == "healthy", "e1")
        assert e1 == {"id": "e1", "status": "healthy"}
        e0 = await engine_status_until(
            served, session, lambda e: e.get("last_ft_request_id") == second
        )
        assert e0["status"] == "healthy"
        counts = {
            engine_id: (
                _metric(served, "shoal:engine_faults_total", engine_id),
                _metric(served, "shoal:engine_recoveries_total", engine_id),
            )
            for engine_id in ("e0", "e1")
        }
        assert counts == {"e0": (0, 0), "e1": (1, 1)}
        body = {"prompt": "the quick", "max_tokens": 4, "ignore_eos": True}
        assert (await complete(session, served.url, body)).finish_reason == "length"


async def apply_retry(served: ServedStack, session: aiohttp.ClientSession) -> str:
    status, answer = await apply(served, session, {"instruction": "retry", "params": {}})
    assert status == 202, answer
    return str(answer["request_id"])
