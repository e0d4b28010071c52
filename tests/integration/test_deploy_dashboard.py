"""The Grafana dashboard (deploy/grafana/shoal-dashboard.json) names only metrics that a real
gateway's ``/metrics`` exports: a local in-memory deployment of the tiny model with every
feature the dashboard shows (prefix caching, speculative decoding, a KV offload CPU tier, fault
tolerance) serves one request, and the metric names come from its ``/metrics`` text."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shoal.bus.transport.memory import InMemoryBroker, InMemoryBus
from shoal.deploy.deployment import build_config, plan_actors, start_in_process, stop_in_process
from shoal.gateway.actor import GatewayActor

pytestmark = pytest.mark.timeout(180)
DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "shoal-dashboard.json"
METRIC = re.compile(r"\b(?:vllm|shoal):[A-Za-z0-9_:]+")
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
}


def exported_names(text: str) -> set[str]:
    """Every series name the exposition defines, those of families with no series yet too."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
        names |= {sample.name for sample in family.samples}
    return names


def dashboard_names() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return {name for expr in exprs for name in METRIC.findall(expr)}


async def test_dashboard_names_only_exported_metrics(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    config = build_config(
        model=str(tiny_checkpoint("llama")),
        max_model_len=128,
        num_gpu_blocks_override=64,
        enable_prefix_caching=True,
        kv_offloading_size=0.01,
        enable_fault_tolerance=True,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        namespace="dashtest",
        bus="memory",
    )
    bus = InMemoryBus(InMemoryBroker())
    await bus.connect()
    actors = await start_in_process(bus, plan_actors(config))
    gateway = GatewayActor(bus, "gateway-0", config=config, port=0)
    try:
        await gateway.start()
        assert gateway.http is not None
        await gateway.engine.wait_until_ready(60, 1)  # type: ignore[union-attr]
        async with aiohttp.ClientSession() as session:
            body = {"model": gateway.metrics.model_name if gateway.metrics else "", "prompt": "ab"}
            async with session.post(
                gateway.http.url + "/v1/completions", json={**body, "max_tokens": 4}
            ) as response:
                assert response.status == 200, await response.text()
            async with session.get(gateway.http.url + "/metrics") as response:
                text = await response.text()
    finally:
        await gateway.stop()
        await stop_in_process(actors)
        await bus.close()
    exported = exported_names(text)
    assert "vllm:spec_decode_num_drafts_total" in exported  # the features the panels show are on
    assert "vllm:kv_offload_tiering_chunk_queries_total" in exported
    wanted = dashboard_names()
    assert len(wanted) > 20
    assert sorted(wanted - exported) == []
