"""In-memory bus specifics: named brokers."""

from __future__ import annotations

from shoal.bus.transport.memory import InMemoryBus


async def test_named_brokers_are_shared_and_released():
    import gc

    from shoal.bus import make_bus
    from shoal.bus.transport.memory import _NAMED_BROKERS

    first, second = make_bus("memory://shared-test"), make_bus("memory://shared-test")
    assert isinstance(first, InMemoryBus) and isinstance(second, InMemoryBus)
    assert first.broker is second.broker
    del first, second
    gc.collect()
    assert "shared-test" not in _NAMED_BROKERS


async def test_connect_bus_urls():
    import pytest

    from shoal.bus import connect_bus, make_bus
    from shoal.bus.transport.nats_bus import NatsBus

    bus = await connect_bus("memory")
    assert isinstance(bus, InMemoryBus) and bus.is_connected
    await bus.close()
    assert not bus.is_connected
    nats_bus = make_bus("nats://10.0.0.1:4222,nats://10.0.0.2:4222", token="t")
    assert isinstance(nats_bus, NatsBus)
    assert nats_bus.servers == ["nats://10.0.0.1:4222", "nats://10.0.0.2:4222"]
    with pytest.raises(ValueError, match="unknown bus url"):
        make_bus("redis://localhost")
