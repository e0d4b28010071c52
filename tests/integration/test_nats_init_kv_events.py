"""``shoal nats-init`` on a deployment whose kv-events stream an older shoal made (capturing the
engine cores' ``kv_events`` only): it adds the tiers' subject (``tier_kv_events``), once, and a
client that follows the stream afterwards indexes a CPU tier's chunks from it (real
nats-server)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.bus.subjects import Subjects
from shoal.bus.transport.nats_bus import NatsBus
from shoal.config.deployment import ShoalConfig
from shoal.deploy.cli import build_parser
from shoal.deploy.nats_init import run_nats_init
from shoal.engine.client.prefix_routing import PrefixRouting
from shoal.kv_events.stream import open_kv_events_stream
from shoal.tiers.books.keys import get_offload_block_hash
from tests.actors.test_cpu_tier_actor import Deployment, K
from tests.integration.conditions import wait_for

LIMIT_S = 10.0


async def test_nats_init_adds_the_tier_subject_to_an_older_stream(
    nats_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name in ("SHOAL_NATS_USER", "SHOAL_NATS_PASSWORD", "SHOAL_NATS_PASSWORD_FILE"):
        monkeypatch.delenv(name, raising=False)
    bus = NatsBus([nats_url])
    await bus.connect()
    deployment = Deployment(bus, tmp_path)
    subjects = Subjects(deployment.namespace)
    older = [subjects.kv_events("*")]  # what an older shoal's stream captured
    await bus.open_stream(subjects.kv_events_stream(), older, max_age_s=120.0)
    routing: PrefixRouting | None = None
    try:
        argv = ["nats-init", "--nats-url", nats_url, "--namespace", deployment.namespace]
        assert await run_nats_init(build_parser().parse_args(argv)) == 0
        assert f"now also capturing {subjects.tier_kv_events('*')}" in capsys.readouterr().out
        stream = await open_kv_events_stream(bus, subjects)
        assert set(stream.subjects) == {subjects.kv_events("*"), subjects.tier_kv_events("*")}
        assert await run_nats_init(build_parser().parse_args(argv)) == 0  # idempotent
        assert "now also capturing" not in capsys.readouterr().out

        tier = await deployment.start_tier(
            deployment.kv_config(num_slots=4), kv_events_snapshot_interval_s=30.0
        )
        region = await deployment.attach()
        await deployment.store(region, K[0], K[1])
        config = ShoalConfig.from_options(model="m", routing_mode="kv")
        routing = PrefixRouting(bus, subjects, config)
        await routing.start()  # follows the stream: replays the tier's batches
        want = {get_offload_block_hash(k) for k in (K[0], K[1])}
        await wait_for(
            lambda: routing is not None and routing.index.hashes_of(tier.actor_id, "cpu") == want,
            LIMIT_S,
            "the tier's chunks from the stream",
        )
    finally:
        if routing is not None:
            await routing.stop()
        for actor in reversed(deployment.actors):
            await actor.stop()
        await bus.close()
