"""The engine core's link to its CPU tier on its own (in-memory bus, a scheduler with a
connector, a listener on the tier's subject): it renews exactly what the engine core holds,
every ``RENEW_INTERVAL_S``, and nothing when it holds nothing."""

from __future__ import annotations

import asyncio

import pytest

from shoal.bus.codec import Codec, DecodeError
from shoal.bus.messages.offload import KVLayout, TierInbound, TierRenew
from shoal.bus.msg import Msg
from shoal.bus.subjects import Subjects
from shoal.bus.transport.memory import InMemoryBroker, InMemoryBus
from shoal.config.deployment import ShoalConfig
from shoal.engine.actor import offload_link
from shoal.engine.actor.offload_link import OffloadLink
from shoal.engine.core.offload_port import OffloadPort
from tests.integration.conditions import wait_for
from tests.unit.offload_fakes import make_offload_scheduler

pytestmark = [pytest.mark.timeout(30), pytest.mark.asyncio]

LAYOUT = KVLayout("tiny", 2, 16, 2, 16, "float32", 1, 1)
OFFLOAD = {
    "kv_transfer_config": {
        "kv_connector": "OffloadingConnector",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 20, "kv_lookup_timeout_s": 0.1},
    }
}


async def test_the_link_renews_what_the_engine_core_holds(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(offload_link, "RENEW_INTERVAL_S", 0.05)
    bus = InMemoryBus(InMemoryBroker())
    await bus.connect()
    config = ShoalConfig.from_options(model="m", **OFFLOAD)
    scheduler = make_offload_scheduler()
    assert scheduler.connector is not None
    held = [b"k1" * 8, b"k2" * 8]
    monkeypatch.setattr(scheduler.connector, "held_keys", lambda: list(held))
    renewals: list[TierRenew] = []
    codec: Codec[TierInbound] = Codec(TierInbound)

    async def tier(msg: Msg) -> None:  # answers nothing: attaches fail and are retried
        try:
            message = codec.decode(msg.data)
        except DecodeError:
            return
        if isinstance(message, TierRenew):
            renewals.append(message)

    subjects = Subjects()
    await bus.subscribe(subjects.tier_in("kv-cpu"), tier)
    link = OffloadLink(bus, subjects, config, "engine-0.inc", lambda: None)
    try:
        link.attach(LAYOUT, OffloadPort(scheduler.connector, scheduler.unpark))
        await wait_for(lambda: len(renewals) >= 2, 10, "two renewals")
        assert {(r.owner, tuple(r.keys)) for r in renewals} == {("engine-0.inc", tuple(held))}
        held.clear()
        count = len(renewals)
        await asyncio.sleep(0.3)  # six intervals with nothing held: no renewal
        assert len(renewals) == count
    finally:
        await link.stop()
        await bus.close()
