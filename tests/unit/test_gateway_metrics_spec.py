"""``/metrics`` for speculative decoding: vLLM's ``vllm:spec_decode_*`` counters per engine core
from the cumulative figures of ``SchedulerStats``, the per-position series labelled
``position``, defined only when the deployment speculates; and the gateway actor wiring them
(and the stats log) from the deployment's config."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shoal.bus.messages.engine import SchedulerStats
from shoal.bus.transport.memory import InMemoryBroker, InMemoryBus
from shoal.config.deployment import ShoalConfig
from shoal.gateway.actor import GatewayActor
from shoal.gateway.metrics import Metrics
from tests.unit.test_gateway_fake import FakeEngineClient

pytestmark = pytest.mark.timeout(60)
COUNTERS = {  # series (as exposed) → SchedulerStats field
    "vllm:spec_decode_num_drafts_total": "spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens_total": "spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "spec_decode_num_accepted_tokens",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


def _stats(step: int, drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]):  # type: ignore[no-untyped-def]
    return SchedulerStats(
        step_id=step,
        spec_decode_num_drafts=drafts,
        spec_decode_num_draft_tokens=draft_tokens,
        spec_decode_num_accepted_tokens=accepted,
        spec_decode_num_accepted_tokens_per_pos=per_pos,
        spec_decode_k=3,
    )


def _samples(metrics: Metrics) -> dict[tuple[str, str, str], float]:
    """``(series, engine, position) → value`` of the spec-decode samples (position '' if none)."""
    found: dict[tuple[str, str, str], float] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            if s.name.startswith("vllm:spec_decode") and s.name.endswith("_total"):
                assert s.labels["model_name"] == "m"
                key = (s.name, s.labels["engine"], s.labels.get("position", ""))
                found[key] = s.value
    return found


def test_counters_per_engine_with_a_position_label() -> None:
    metrics = Metrics("m", num_speculative_tokens=3)
    metrics.update_engine_stats(_stats(1, 4, 12, 5, [3, 2, 0]), "e0")
    metrics.update_engine_stats(_stats(2, 10, 30, 17, [8, 6, 3]), "e0")  # cumulative
    metrics.update_engine_stats(_stats(1, 1, 3, 1, [1]), "e1")
    found = _samples(metrics)
    assert found[("vllm:spec_decode_num_drafts_total", "e0", "")] == 10
    assert found[("vllm:spec_decode_num_draft_tokens_total", "e0", "")] == 30
    assert found[("vllm:spec_decode_num_accepted_tokens_total", "e0", "")] == 17
    assert [found[(PER_POS, "e0", str(p))] for p in range(3)] == [8, 6, 3]
    assert found[("vllm:spec_decode_num_drafts_total", "e1", "")] == 1
    # Every position up to K exists from an engine core's first report, at 0 if unreported.
    assert [found[(PER_POS, "e1", str(p))] for p in range(3)] == [1, 0, 0]
    assert (PER_POS, "e0", "3") not in found
    text = metrics.render().decode()
    for name in (*COUNTERS, PER_POS):  # this exposition types the _total name
        assert f"# TYPE {name} counter" in text


def test_all_series_exist_at_zero_from_the_first_report() -> None:
    metrics = Metrics("m", num_speculative_tokens=2)
    metrics.update_engine_stats(SchedulerStats(step_id=1), "e0")
    found = _samples(metrics)
    assert {k: v for k, v in found.items() if k[1] == "e0"} == {
        **{(name, "e0", ""): 0.0 for name in COUNTERS},
        (PER_POS, "e0", "0"): 0.0,
        (PER_POS, "e0", "1"): 0.0,
    }


def test_a_restarted_core_counts_afresh_and_late_reports_are_ignored() -> None:
    metrics = Metrics("m", num_speculative_tokens=2)
    metrics.update_engine_stats(_stats(20, 10, 20, 12, [7, 5]), "e0")
    metrics.update_engine_stats(_stats(19, 9, 18, 11, [6, 5]), "e0")  # late: ignored
    metrics.update_engine_stats(_stats(3, 2, 4, 3, [2, 1]), "e0")  # restarted: counters fell
    found = _samples(metrics)
    assert found[("vllm:spec_decode_num_drafts_total", "e0", "")] == 12
    assert found[("vllm:spec_decode_num_accepted_tokens_total", "e0", "")] == 15
    assert [found[(PER_POS, "e0", str(p))] for p in range(2)] == [9, 6]
    # A core that restarted and ran past the last step seen before it reported: figures fell.
    metrics.update_engine_stats(_stats(30, 1, 2, 1, [1, 0]), "e0")
    found = _samples(metrics)
    assert found[("vllm:spec_decode_num_drafts_total", "e0", "")] == 13
    assert [found[(PER_POS, "e0", str(p))] for p in range(2)] == [10, 6]


def test_no_spec_series_when_the_deployment_does_not_speculate() -> None:
    metrics = Metrics("m")
    metrics.update_engine_stats(_stats(1, 4, 12, 5, [3, 2, 0]), "e0")
    assert _samples(metrics) == {}
    assert "spec_decode" not in metrics.render().decode()


class ReportingEngine(FakeEngineClient):
    """A fake that passes engine stats on to listeners, like AsyncEngineClient."""

    def __init__(self) -> None:
        super().__init__()
        self.stats_listeners: list = []  # type: ignore[type-arg]


@pytest.mark.parametrize("speculative", [True, False])
async def test_the_gateway_actor_defines_them_from_the_deployments_config(
    speculative: bool,
) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 2} if speculative else None
    config = ShoalConfig.from_options(model="m", bus="memory", speculative_config=spec)
    engine = ReportingEngine()
    actor = GatewayActor(
        InMemoryBus(InMemoryBroker()), "gw-1", config=config, engine_client=engine, port=0
    )
    await actor.start()
    try:
        engine.stats_listeners[0](_stats(1, 4, 8, 3, [2, 1]), "e0")
        assert actor.metrics is not None
        value = actor.metrics.registry.get_sample_value(
            PER_POS, {"model_name": engine.model_name, "engine": "e0", "position": "1"}
        )
        assert value == (1 if speculative else None)
        assert (actor.stats_logger is not None) == speculative
    finally:
        await actor.stop()
