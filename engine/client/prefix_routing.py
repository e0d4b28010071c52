"""The engine client's side of prefix-aware routing (``routing_mode`` kv): follows the
kv-events stream into a ``prefix_index.PrefixIndex`` (every stored batch first, so a restarted
client or gateway rebuilds its index, then live ones: the engine cores' and the KV tiers'),
drops an engine core's or a tier's entries when it is seen DEAD or STOPPED (it watches the
tiers' liveness itself, and follows a restarted tier's new incarnation), and hashes prompts
the way the engine cores do (``BlockHasher``, with the deployment's block size, hash algorithm
and the request's cache salt), so the router can look them up: only when there is a choice
(two engine cores ready or more) and the engine core would use its cache (a request asking for
prompt logprobs computes its whole prompt: routed by load).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence, Sized

from shoal.bus.base import Bus, Subscription
from shoal.bus.codec import Codec, DecodeError
from shoal.bus.errors import BusError
from shoal.bus.event_stream import StreamFollower
from shoal.bus.messages.kv_events import KVEventBatch
from shoal.bus.messages.sampling import SamplingParams
from shoal.bus.msg import Msg
from shoal.bus.runtime.liveness import GONE_STATES, LivenessTable, watch_liveness
from shoal.bus.subjects import Subjects
from shoal.config.deployment import ShoalConfig
from shoal.engine.client.prefix_index import PrefixIndex
from shoal.engine.core.block_hash import BlockHash, BlockHasher
from shoal.kv_events.stream import kv_events_subjects, open_kv_events_stream

log = logging.getLogger(__name__)
_BATCH: Codec[KVEventBatch] = Codec(KVEventBatch)


class PrefixRouting:
    def __init__(self, bus: Bus, subjects: Subjects, config: ShoalConfig) -> None:
        cache = config.cache_config
        self._bus = bus
        self._subjects = subjects
        self._replicas = config.bus_config.jetstream_replicas
        self._snapshot_interval_s = config.parallel_config.kv_events_snapshot_interval_s
        self.index = PrefixIndex(cache.block_size)
        self.hasher = BlockHasher(cache.block_size, cache.prefix_caching_hash_algo)
        self.tiers = LivenessTable()  # the KV tiers' heartbeats and statuses
        self.follower: StreamFollower | None = None
        self._subs: list[Subscription] = []

    async def start(self, replay_timeout_s: float = 10.0) -> None:
        """Follow the stream and wait (bounded) until what it stored has been applied; without
        a stream (a bus that has none, or JetStream off), follow the live events only."""
        self._subs = await watch_liveness(
            self._bus, self._subjects, "tier", self.tiers, on_change=self.on_tier_change
        )
        try:
            stream = await open_kv_events_stream(
                self._bus, self._subjects, self._replicas, self._snapshot_interval_s
            )
            self.follower = await stream.follow(self._on_batch)
        except (BusError, NotImplementedError, OSError) as exc:
            log.warning("kv-events stream unavailable (%r): following live events only", exc)
            for subject in kv_events_subjects(self._subjects):
                sub = await self._bus.subscribe(subject, self._on_batch, sequential=True)
                self._subs.append(sub)
            return
        try:
            await asyncio.wait_for(self.follower.caught_up.wait(), replay_timeout_s)
        except TimeoutError:
            log.warning("kv-events replay not done after %s s: routing on", replay_timeout_s)

    async def stop(self) -> None:
        follower, self.follower = self.follower, None
        if follower is not None:
            await follower.stop()
        subs, self._subs = self._subs, []
        for sub in subs:
            with contextlib.suppress(BusError):
                await sub.unsubscribe()

    async def _on_batch(self, msg: Msg) -> None:
        try:
            batch = _BATCH.decode(msg.data)
        except DecodeError as exc:
            log.warning("undecodable kv events on %s: %s", msg.subject, exc)
            return
        self.index.apply(batch)

    def on_engine_change(self, engine_id: str, liveness: LivenessTable) -> None:
        """An engine core's state changed: a gone one holds nothing any more."""
        peer = liveness.get(engine_id)
        if peer is not None and peer.state in GONE_STATES:
            self.index.drop_source(engine_id)

    def on_tier_change(self, tier_id: str) -> None:
        """A tier's state changed: a gone one holds nothing any more, and a restarted one's
        old life must not steer until its new one's snapshot comes."""
        peer = self.tiers.get(tier_id)
        if peer is None:
            return
        if peer.state in GONE_STATES:
            self.index.drop_source(tier_id)
        else:
            self.index.follow_incarnation(tier_id, peer.incarnation, peer.retired)

    def request_hashes(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        ready_engines: Callable[[], Sized],
        lora_name: str | None = None,
    ) -> list[BlockHash]:
        """The hashes to route a request by: none (by load) when fewer than two engine cores
        are ready (nothing to choose) or the request skips the prefix cache (prompt
        logprobs). ``lora_name``: the request's adapter, a key of every block."""
        if params.prompt_logprobs is not None or len(ready_engines()) < 2:
            return []
        return self.block_hashes(prompt_token_ids, lora_name=lora_name)

    def block_hashes(
        self,
        prompt_token_ids: Sequence[int],
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> list[BlockHash]:
        """The prompt's blocks an engine core could take from its cache (never the block of
        the last token, whose logits must be computed)."""
        max_blocks = (len(prompt_token_ids) - 1) // self.hasher.block_size
        return self.hasher.prompt_block_hashes(prompt_token_ids, cache_salt, max_blocks, lora_name)
