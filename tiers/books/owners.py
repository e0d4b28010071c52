"""Who holds what in a tier, and since when: the pins and unfinished stores of each owner.

Pure bookkeeping beside the ``OffloadManager`` (no I/O, no clock: callers pass ``now``). An owner
is an engine core incarnation (``engine_id/incarnation``) or the tier itself (a cascade's pins, a
promotion's reserved slots). Every pin and every pending store carries the time it was taken; one
older than the lease is handed back by ``expire`` so the tier can unpin it or fail it, and a dead
owner (or a reply that never came) never leaks slots.

An owner that still holds something renews it (``renew``: the engine core's link does so
every few seconds, naming a key once per pin or store it holds), so only a silent owner's
holdings run out, and so do pins it never learnt of (a lookup it gave up on): renewal is
counted, never "every pin of this key". Only what an owner holds is given
back: a release naming keys it never pinned (an engine core that outlived a tier restart) or
stores it does not own is ignored, key by key.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from shoal.tiers.books.keys import OffloadKey


@dataclass(slots=True)
class _Holdings:
    pins: dict[OffloadKey, deque[float]] = field(default_factory=dict)  # one time per pin
    stores: dict[OffloadKey, float] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.pins and not self.stores


@dataclass(frozen=True, slots=True)
class Expired:
    """What leases ran out: ``pins`` (a key once per pin) to unpin, ``stores`` to fail."""

    pins: list[OffloadKey]
    stores: list[OffloadKey]
    owners: list[str]


class OwnerLeases:
    def __init__(self) -> None:
        self._owners: dict[str, _Holdings] = {}
        self.num_pins = 0
        self.num_stores = 0

    def add_pins(self, owner: str, keys: Iterable[OffloadKey], now: float) -> None:
        """``owner`` pinned ``keys`` (a key named twice holds two pins)."""
        keys = list(keys)
        if not keys:
            return  # an owner holding nothing is not listed
        pins = self._owners.setdefault(owner, _Holdings()).pins
        for key in keys:
            pins.setdefault(key, deque()).append(now)
            self.num_pins += 1

    def take_pins(self, owner: str, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """One pin of ``owner`` per key named (its oldest); keys it does not pin are skipped."""
        holdings = self._owners.get(owner)
        if holdings is None:
            return []
        taken = []
        for key in keys:
            times = holdings.pins.get(key)
            if not times:
                continue
            times.popleft()
            if not times:
                del holdings.pins[key]
            taken.append(key)
        self.num_pins -= len(taken)
        self._forget_if_empty(owner, holdings)
        return taken

    def add_stores(self, owner: str, keys: Iterable[OffloadKey], now: float) -> None:
        """``owner`` is writing ``keys`` (slots reserved, not readable yet)."""
        keys = list(keys)
        if not keys:
            return
        stores = self._owners.setdefault(owner, _Holdings()).stores
        for key in keys:
            if key not in stores:
                self.num_stores += 1
            stores[key] = now

    def take_stores(self, owner: str, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """The keys named that ``owner`` is writing, no longer pending; others are skipped."""
        holdings = self._owners.get(owner)
        if holdings is None:
            return []
        taken = [k for k in dict.fromkeys(keys) if holdings.stores.pop(k, None) is not None]
        self.num_stores -= len(taken)
        self._forget_if_empty(owner, holdings)
        return taken

    def renew(self, owner: str, keys: Iterable[OffloadKey], now: float) -> int:
        """``owner`` still holds ``keys``, one entry per pin or pending store: its pending store
        on a key (if any) and then as many of its pins as the key's remaining entries count from
        ``now``; returns how many were renewed. Pins past that count (ones the owner does not
        know about: a lookup it gave up on) keep ageing; keys it does not hold are skipped."""
        holdings = self._owners.get(owner)
        if holdings is None:
            return 0
        num_renewed = 0
        for key, count in Counter(keys).items():
            if key in holdings.stores:
                holdings.stores[key] = now
                num_renewed += 1
                count -= 1
            times = holdings.pins.get(key)
            if times and count > 0:
                num = min(count, len(times))
                for _ in range(num):  # the newest ``num``: the deque stays oldest first
                    times.pop()
                times.extend([now] * num)
                num_renewed += num
        return num_renewed

    def expire(self, cutoff: float) -> Expired:
        """Take every pin and pending store taken before ``cutoff``."""
        pins: list[OffloadKey] = []
        stores: list[OffloadKey] = []
        owners = []
        for owner, holdings in list(self._owners.items()):
            num_before = len(pins) + len(stores)
            for key, times in list(holdings.pins.items()):
                while times and times[0] < cutoff:
                    times.popleft()
                    pins.append(key)
                if not times:
                    del holdings.pins[key]
            for key, since in list(holdings.stores.items()):
                if since < cutoff:
                    del holdings.stores[key]
                    stores.append(key)
            if len(pins) + len(stores) > num_before:
                owners.append(owner)
            self._forget_if_empty(owner, holdings)
        self.num_pins -= len(pins)
        self.num_stores -= len(stores)
        return Expired(pins, stores, owners)

    def owners(self) -> list[str]:
        """Owners holding anything."""
        return list(self._owners)

    def _forget_if_empty(self, owner: str, holdings: _Holdings) -> None:
        if holdings.is_empty:
            self._owners.pop(owner, None)
