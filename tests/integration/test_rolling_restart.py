"""``shoal restart --rolling`` under a steady load of streamed greedy completions: every actor of
a process deployment (two engine cores with a worker each, a CPU KV tier, the recovery
controller, two gateways behind the client's failover) restarted once, one at a time, and not
one request failed or changed its text. With ``shoal serve``'s one engine core it refuses
what would take that core down, restarts what would not, and skips the gateway that lives in
``shoal serve``'s own process."""

from __future__ import annotations

import asyncio
import json
import re
import sys

import aiohttp
import pytest

from bench.rolling import (
    FailoverClient,
    calm_check,
    process_deployment,
    rolling_restart,
    steady_load,
)
from shoal.bus.runtime.actor import EXIT_RESTART_REQUESTED
from shoal.bus.runtime.supervisor import ChildState
from shoal.deploy.deployment import build_config
from shoal.deploy.restart_cli import EXIT_OK, EXIT_REFUSED
from tests.integration.serve_process import Server

pytestmark = [pytest.mark.slow, pytest.mark.nats, pytest.mark.timeout(600)]
PROMPTS = [f"rolling {i}: the fox and the {word}" for i, word in enumerate("abcdef")]
NAMESPACE = "rolling"
MAX_TOKENS = 48


async def test_a_rolling_restart_under_load_loses_no_request(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    config = build_config(
        model=str(tiny_checkpoint("llama")), namespace=NAMESPACE, dtype="float32",
        data_parallel_size=2, kv_offloading_size=0.01, enable_prefix_caching=True,
        num_gpu_blocks_override=256, max_num_seqs=8,
    )  # fmt: skip
    timeout = aiohttp.ClientTimeout(total=300)
    async with (
        process_deployment(config) as deployed,
        aiohttp.ClientSession(timeout=timeout) as session,
    ):
        client = FailoverClient(session, deployed.gateway_urls, max_tokens=MAX_TOKENS)
        calm_done = asyncio.Event()
        calm_done.set()
        calm = await steady_load(client, PROMPTS, 4.0, calm_done, min_requests=2 * len(PROMPTS))
        check, disagreements = calm_check(calm, MAX_TOKENS, slo_factor=3.0)
        assert disagreements == 0 and len(check.reference) == len(PROMPTS)
        stop = asyncio.Event()
        load = asyncio.create_task(steady_load(client, PROMPTS, 3.0, stop, seed=1))
        status, summary = await rolling_restart(deployed.nats_url, NAMESPACE)
        stop.set()
        during = await load
        supervisor = deployed.supervisor
        children = [e.name for e in supervisor.events if e.state is ChildState.RUNNING]
        exits = [(e.name, e.returncode) for e in supervisor.events if e.state is ChildState.EXITED]
    assert status == EXIT_OK, summary
    actors = summary["actors"]
    expected = {"worker-0-0", "worker-1-0", "engine-0", "engine-1", "gateway-0", "gateway-1"}
    assert expected <= {a["id"] for a in actors}
    assert {a["kind"] for a in actors} == {"worker", "engine", "gateway", "tier", "recovery"}
    for actor in actors:  # each once, into a new life
        assert actor["result"] == "restarted", actor
        assert actor["new_incarnation"] and actor["new_incarnation"] != actor["old_incarnation"]
    assert sorted(exits) == sorted((a["id"], EXIT_RESTART_REQUESTED) for a in actors)
    assert len(children) == 2 * len(actors)  # each child started twice: once more per restart
    assert [a["kind"] for a in actors][:1] == ["recovery"] and actors[-1]["kind"] == "gateway"
    assert len(during) >= 20  # the load ran through the whole restart
    lost = check.lost(during)
    assert lost == [], [(a.prompt, a.error, a.num_tokens, a.text) for a in lost]


async def test_restart_keeps_the_last_engine_core_and_skips_an_in_process_gateway(
    tiny_checkpoint,
) -> None:  # type: ignore[no-untyped-def]
    server = Server(tiny_checkpoint("llama"))
    try:
        await asyncio.to_thread(server.wait_for, r"is serving .* on (http://\S+)", 240)
        nats_url = server.wait_for(r"embedded nats-server pid \d+ listening on (\S+)", 5)
        for targets in ([], ["worker"], ["engine-0"]):
            status, summary = await restart(nats_url, "--rolling", *targets)
            assert status == EXIT_REFUSED and summary == {}, targets
        status, summary = await restart(nats_url, "recovery", "gateway")
        assert status == EXIT_OK
        outcomes = {a["kind"]: a for a in summary["actors"]}
        assert outcomes["recovery"]["result"] == "restarted"
        assert outcomes["gateway"]["result"] == "skipped"
        assert "shares its process" in outcomes["gateway"]["detail"]
        assert len(re.findall(r"process recovery-0: running", server.text)) == 2  # a new life
        assert len(re.findall(r"process worker-0-0: running", server.text)) == 1  # untouched
    finally:
        server.stop()


async def restart(nats_url: str, *args: str) -> tuple[int, dict[str, object]]:
    command = [sys.executable, "-m", "shoal.deploy.cli", "restart", "--json", "--listen-s", "2",
               "--nats-url", nats_url, *args]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    last = out.decode().strip().splitlines()[-1:] or [""]
    summary = json.loads(last[0]) if last[0].startswith("{") else {}
    return proc.returncode or 0, summary
