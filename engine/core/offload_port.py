"""The engine core's one door for its KV offload link (``engine/actor/offload_link.py``): the
link takes the outbox it hands out and reports the tier's answers to the handlers it owns, and
never reaches into the scheduler or the connector behind it.

A lookup's answer (or its failure) goes to the connector and puts the parked request back in
the waiting queue; a store offer's answer (slots, or none) goes to the connector, whose next
step carries the copies.
"""

from __future__ import annotations

from collections.abc import Callable

from shoal.bus.messages.offload import RegionRef, TierLookupReply, TierRenew, TierStoreSlots
from shoal.engine.core.offload_connector import OffloadConnector, OffloadOutbox
from shoal.engine.core.request import Request
from shoal.tiers.books.keys import OffloadKey


class OffloadPort:
    """An engine core's offload connector, as its link sees it."""

    def __init__(self, connector: OffloadConnector, unpark: Callable[[Request | None], None]):
        """``unpark``: the scheduler's, which queues a request whose lookup ended."""
        self._connector = connector
        self._unpark = unpark

    @property
    def region(self) -> RegionRef | None:
        """The tier's region this engine core is attached to (None: not yet)."""
        return self._connector.region

    def attached(self, region: RegionRef) -> None:
        """The tier answered an attach with ``region`` (another generation voids old grants)."""
        self._connector.set_region(region)

    def take_outbox(self, owner: str) -> OffloadOutbox:
        """What to send the tier since the last call (releases signed by ``owner``)."""
        return self._connector.take_outbox(owner)

    def lookup_answered(
        self,
        request_id: str,
        lookup_id: int,
        keys: list[OffloadKey],
        reply: TierLookupReply | None,
    ) -> None:
        """The tier's answer to a lookup, or None when it failed or timed out (a miss)."""
        connector = self._connector
        if reply is None:
            self._unpark(connector.on_lookup_failed(request_id, lookup_id))
        else:
            self._unpark(connector.on_lookup_reply(request_id, lookup_id, keys, reply))

    def store_answered(self, job_id: int, reply: TierStoreSlots | None) -> None:
        """The tier's slots for a store offer, or None (refused, failed: the store is dropped)."""
        self._connector.on_store_slots(job_id, reply)

    def renewal(self, owner: str) -> TierRenew | None:
        """The leases to renew at the tier: what this engine core holds there (None: nothing)."""
        keys = self._connector.held_keys()
        if not keys:
            return None
        return TierRenew(owner, keys, self._connector.generation)
