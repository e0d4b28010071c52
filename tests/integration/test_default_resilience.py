"""Resilience with default flags: ``shoal serve MODEL`` and nothing else (fault tolerance, the
recovery controller and request resumption are on by default). Under a load of streamed greedy
completions, SIGKILL of the worker, of the engine core and of the embedded nats-server, each in
its own round: every request in flight completes, with the text the calm round gave it; and the
gateway counts the engine fault they were resumed across (``/metrics``)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal

import aiohttp
import pytest

from tests.integration.conditions import wait_http_ready
from tests.integration.serve_process import Server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
PROMPTS = [f"story {i}: the fox and the {word}" for i, word in enumerate("abcdef")]
MAX_TOKENS = 600


async def stream(
    session: aiohttp.ClientSession, url: str, prompt: str, started: asyncio.Event
) -> str:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    text = ""
    async with session.post(f"{url}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            text += chunk["choices"][0]["text"]
            if text:
                started.set()
    return text


async def load(url: str, kill: tuple[Server, str] | None = None) -> list[str]:
    """Every prompt streamed at once; with ``kill``, that target SIGKILLed once every stream
    has begun (and none has ended)."""
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        started = [asyncio.Event() for _ in PROMPTS]
        tasks = [
            asyncio.create_task(stream(session, url, p, s))
            for p, s in zip(PROMPTS, started, strict=True)
        ]
        if kill is not None:
            await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 60)
            server, target = kill
            os.kill(server.pid_of(target), signal.SIGKILL)
            assert not any(task.done() for task in tasks), "a stream ended before the kill"
        return list(await asyncio.gather(*tasks))


async def faults_seen(url: str) -> float:
    """The engine core faults the gateway saw (``shoal:engine_faults_total``, all engines)."""
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as response:
        text = await response.text()
    found = re.findall(r"^shoal:engine_faults_total(?:\{[^}]*\})? (\S+)$", text, re.M)
    return sum(float(value) for value in found)


@pytest.mark.parametrize("target", ["worker-0-0", "engine-0", "nats-server"])
async def test_in_flight_requests_survive_a_kill_with_default_flags(
    tiny_checkpoint, target
) -> None:  # type: ignore[no-untyped-def]
    server = Server(tiny_checkpoint("llama"))  # with --no-enable-fault-tolerance: all 3 fail
    try:
        url = await asyncio.to_thread(server.wait_for, r"is serving .* on (http://\S+)", 240)
        calm = await load(url)
        assert all(len(text) > 0 for text in calm)
        before = await faults_seen(url)
        try:
            cut = await load(url, (server, target))
        except AssertionError as exc:  # a stream's error: the deployment's log says why
            raise AssertionError(f"{exc}\nshoal serve's output:\n{server.text[-6000:]}") from exc
        assert cut == calm, server.text[-4000:]
        await wait_http_ready(url, 120)
        if target == "nats-server":
            await asyncio.to_thread(server.wait_for, r"nats-server restarted: pid \d+", 30)
        else:  # a fault the requests were resumed across
            assert await faults_seen(url) > before
    finally:
        server.stop()
