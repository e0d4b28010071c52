"""The prefill side of disaggregated prefill: KV held for a remote decode (issue 33).

A request added with ``KVTransferParams.do_remote_decode`` runs on a prefill engine core like any
other; when it ends capped by ``max_tokens`` (the router sends it with 1: the decode side goes on
from its first token; a request that stopped has nothing left to decode) its prompt's KV is not
given back with its blocks: ``hold`` takes one extra reference on each block that holds landed
prompt KV, so the block stays allocated (and out of eviction) however the request's own blocks are
freed, and says where the KV is (``KVTransferParams``: this engine core, block ids in order, the
tokens they hold, its workers' exported caches). The decode side pulls the blocks and sends
``ReleaseKV``: ``release`` drops the references. A hold nobody releases ends with its lease
(``expire``), so a lost decode side never pins blocks for ever. Aborted and failed requests hold
nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shoal.bus.messages.engine import DEFAULT_KV_LEASE_S, KVTransferParams
from shoal.bus.messages.kv_handover import KVExportRef
from shoal.engine.core.block_pool import BlockPool


@dataclass(slots=True)
class _Hold:
    blocks: list[int]  # block ids
    expires_at: float


class KVHandovers:
    """Holds of prompt KV for remote decodes, over one block pool."""

    def __init__(self, block_pool: BlockPool, block_size: int, lease_s: float = DEFAULT_KV_LEASE_S):
        self.block_pool = block_pool
        self.block_size = block_size
        self.lease_s = lease_s
        # Where a decode side finds the KV: this engine core and its workers' exported caches
        # (``set_source``; none: it cannot pull, and recomputes).
        self.engine_id = ""
        self.exports: list[KVExportRef] = []
        self._holds: dict[str, _Hold] = {}
        self.num_held = 0  # holds made (cumulative)
        self.num_released = 0
        self.num_expired = 0

    def set_source(self, engine_id: str, exports: list[KVExportRef]) -> None:
        """This engine core and its workers' caches, as its workers last described them."""
        self.engine_id, self.exports = engine_id, exports

    @property
    def num_holding(self) -> int:
        return len(self._holds)

    def hold(
        self,
        request_id: str,
        blocks: list[int],
        num_prompt_tokens: int,
        num_landed_tokens: int,
        now: float,
    ) -> KVTransferParams:
        """Hold the blocks of ``blocks`` (a request's table) that hold landed prompt KV, until
        ``release`` or ``now + lease_s``; where they are. A request held again (its id reused)
        gives the older hold back first."""
        self._drop(request_id)
        num_tokens = min(num_prompt_tokens, num_landed_tokens)
        held = blocks[: -(-num_tokens // self.block_size)]
        self.block_pool.touch(held)
        self._holds[request_id] = _Hold(held, now + self.lease_s)
        self.num_held += 1
        return KVTransferParams(
            do_remote_decode=True,
            remote_engine_id=self.engine_id,
            remote_block_ids=list(held),
            num_remote_tokens=num_tokens,
            remote_kv=self.exports,
            lease_s=self.lease_s,
        )

    def release(self, request_ids: Iterable[str]) -> int:
        """Give these holds back (unknown ids are skipped); how many there were."""
        released = sum(self._drop(request_id) for request_id in request_ids)
        self.num_released += released
        return released

    def expire(self, now: float) -> list[str]:
        """Give back the holds whose lease ended by ``now``; their request ids."""
        expired = [rid for rid, hold in self._holds.items() if hold.expires_at <= now]
        for request_id in expired:
            self._drop(request_id)
        self.num_expired += len(expired)
        return expired

    def release_all(self) -> None:
        """Every hold given back (the engine core's KV is gone: a fault, a reset)."""
        for request_id in list(self._holds):
            self._drop(request_id)

    def _drop(self, request_id: str) -> bool:
        """Drop the hold's references (its blocks become free unless used elsewhere)."""
        hold = self._holds.pop(request_id, None)
        if hold is None:
            return False
        self.block_pool.free_blocks(reversed(hold.blocks))
        return True
