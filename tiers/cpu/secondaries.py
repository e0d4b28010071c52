"""The CPU tier's link to one secondary tier (filesystem, ...): attach, lookup, promote, cascade.

Every request is bounded. A secondary that does not answer, answers with an error or cannot be
reached is marked detached; the CPU tier then leaves it out (a lookup finds fewer chunks, a
cascade is dropped) and attaches it again in the background, at most once per ``retry_s``, so
a dead or slow secondary never holds up an engine core.

A request that timed out may still be running on the secondary (it may still be reading or
writing region slots): ``SecondaryTimeout`` tells the caller to keep those slots held until the
job's deadline has passed instead of freeing them at once. A timeout detaches the link only when
the wait was the link's own (``timeout_s``): one cut short by the caller's budget says nothing
about the secondary.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from shoal.bus.base import ERROR_CODE_HEADER, Bus
from shoal.bus.codec import Codec, DecodeError, encode
from shoal.bus.errors import BusError, BusTimeoutError
from shoal.bus.messages.offload import (
    KVLayout,
    RegionRef,
    TierAttach,
    TierCascade,
    TierError,
    TierHeld,
    TierJobDone,
    TierLookup,
    TierPromote,
)
from shoal.bus.runtime.actor import call
from shoal.tiers.books.keys import OffloadKey

log = logging.getLogger(__name__)

_HELD: Codec[TierHeld | TierError] = Codec(TierHeld | TierError)
_JOB: Codec[TierJobDone | TierError] = Codec(TierJobDone | TierError)
_ERROR: Codec[TierError] = Codec(TierError)


class SecondaryTimeout(Exception):
    """The secondary did not answer in time; the job may still be running there."""


class SecondaryFailed(Exception):
    """The secondary could not be reached or refused the request; nothing is running there."""


class SecondaryLink:
    def __init__(
        self,
        bus: Bus,
        secondary_id: str,
        subject: str,
        *,
        owner: str,  # the CPU tier's id: the owner its lookups name
        timeout_s: float,
        retry_s: float,
    ) -> None:
        self.bus = bus
        self.secondary_id = secondary_id
        self.owner = owner
        self.subject = subject
        self.timeout_s = timeout_s  # attach and lookup
        self.retry_s = retry_s
        self.is_attached = False
        self.num_in_flight = 0  # cascades and promotions (timed out ones until their lease ends)
        self.num_attach_failures = 0
        self._attaching: asyncio.Lock = asyncio.Lock()
        self._last_attempt = float("-inf")

    def __repr__(self) -> str:
        state = "attached" if self.is_attached else "detached"
        return f"SecondaryLink({self.owner} → {self.secondary_id}, {state})"

    def claim_retry(self, now: float) -> bool:
        """True, and the attempt recorded, when a detached link is due for an attach (its last
        attempt is ``retry_s`` old and none is running); the caller then calls ``attach``."""
        if self.is_attached or self._attaching.locked() or now - self._last_attempt < self.retry_s:
            return False
        self._last_attempt = now
        return True

    async def attach(self, layout: KVLayout, now: float) -> bool:
        """Attach (bounded); any reply but an error counts. One attempt at a time."""
        async with self._attaching:
            if self.is_attached:
                return True
            self._last_attempt = now
            try:
                reply = await self.bus.request(
                    self.subject, encode(TierAttach(layout)), timeout=self.timeout_s
                )
            except BusError as exc:
                self._attach_failed(repr(exc))
                return False
            if reply.header(ERROR_CODE_HEADER) or _is_tier_error(reply.data):
                self._attach_failed(reply.data.decode(errors="replace"))
                return False
            self.is_attached = True
            log.info("%r: attached", self)
            return True

    def _attach_failed(self, why: str) -> None:
        self.num_attach_failures += 1
        log.warning("%r: attach failed: %s", self, why)

    def detach(self, why: str) -> None:
        if self.is_attached:
            log.warning("%r: detached: %s", self, why)
        self.is_attached = False

    async def held(self, keys: list[OffloadKey], timeout_s: float | None = None) -> int:
        """How many leading ``keys`` the secondary holds (0 when it cannot say in time:
        ``timeout_s``, default ``self.timeout_s``)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            reply = await self._call(TierLookup(self.owner, keys), _HELD, timeout_s)
        except (SecondaryTimeout, SecondaryFailed):
            return 0
        assert isinstance(reply, TierHeld)
        return max(0, min(reply.num_leading, len(keys)))

    async def promote(
        self,
        region: RegionRef,
        keys: list[OffloadKey],
        slot_ids: list[int],
        timeout_s: float,
        deadline: float,
    ) -> TierJobDone:
        """Read ``keys`` into ``slot_ids``, touching none after ``deadline`` (``time.time()``);
        raises ``SecondaryTimeout`` / ``SecondaryFailed``."""
        return await self._job(TierPromote(region, keys, slot_ids, deadline), timeout_s)

    async def cascade(
        self,
        region: RegionRef,
        keys: list[OffloadKey],
        slot_ids: list[int],
        timeout_s: float,
        deadline: float,
    ) -> TierJobDone:
        """Write ``slot_ids`` as ``keys``, touching none after ``deadline`` (``time.time()``);
        raises ``SecondaryTimeout`` / ``SecondaryFailed``."""
        return await self._job(TierCascade(region, keys, slot_ids, deadline), timeout_s)

    async def _job(self, request: TierPromote | TierCascade, timeout_s: float) -> TierJobDone:
        reply = await self._call(request, _JOB, timeout_s)
        assert isinstance(reply, TierJobDone)
        return reply

    async def _call(
        self, request: object, codec: Codec[Any], timeout_s: float
    ) -> TierHeld | TierJobDone:
        try:
            reply = await call(self.bus, self.subject, request, codec, timeout=timeout_s)
        except BusTimeoutError as exc:
            if timeout_s >= self.timeout_s:  # a shorter wait was the caller's budget running out
                self.detach(f"{type(request).__name__}: {exc}")
            raise SecondaryTimeout(str(exc)) from None
        except (BusError, DecodeError) as exc:
            self.detach(f"{type(request).__name__}: {exc!r}")
            raise SecondaryFailed(str(exc)) from None
        if isinstance(reply, TierError):
            self.detach(f"{type(request).__name__}: {reply.message}")
            raise SecondaryFailed(reply.message)
        assert isinstance(reply, TierHeld | TierJobDone)
        return reply


def _is_tier_error(data: bytes) -> bool:
    try:
        _ERROR.decode(data)
    except DecodeError:
        return False
    return True
