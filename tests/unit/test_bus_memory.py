"""In-memory bus specifics: named brokers."""

from __future__ import annotations

from bus.memory import InMemoryBus


async def test_named_brokers_are_shared_and_released():
    import gc

    from bus import make_bus
    from bus.memory import _NAMED_BROKERS

    first, second = make_bus("memory://shared-test"), make_bus("memory://shared-test")
    assert isinstance(first, InMemoryBus) and isinstance(second, InMemoryBus)
    assert first.broker is second.broker
    del first, second
    gc.collect()
    assert "shared-test" not in _NAMED_BROKERS
