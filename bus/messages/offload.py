"""KV offload messages: engine core ↔ tier actors, tier ↔ tier, and the transfers a step carries.

Only control travels here, never KV bytes: a CPU tier owns a shared-memory region of
``num_slots`` slots (``RegionRef``), one offloaded chunk per slot, and the workers of engine
cores on its host copy blocks between their KV cache and those slots (``KVTransfers``, carried
by ``ExecuteStep``). Secondary tiers (filesystem) read and write the same region.

A slot's layout (``KVLayout``): ``[tp_rank][layer][k|v][block_in_chunk][block_size, heads,
head_dim]``, each tensor-parallel rank copying its own part; or, canonical (independent of the
tensor-parallel size), ``[layer][k|v][block_in_chunk][kv_head][block_size, head_dim]`` over
every KV head of the model, each rank copying its heads. Keys are offload keys
(``tiers.books.keys``: block hash + KV group index).

Engine core → CPU tier, request/reply on ``subjects.tier_in(tier_id)``:

- ``TierAttach(layout)`` → ``TierAttached(region)``: the region for this layout (created at the
  first attach; a different layout later is refused with ``TierError``).
- ``TierLookup(owner, keys)`` → ``TierLookupReply``: the longest run of leading keys held,
  **pinned** (never evicted) for ``owner`` until it sends ``TierRelease``; the tier may first
  promote keys from a secondary tier, or wait for another lookup's promotion of them (vLLM's
  RETRY, answered inside the tier: a reply is final).
- ``TierPrepareStore(owner, keys)`` → ``TierStoreSlots``: slots for the keys not held yet
  (evicting idle chunks), not readable until the owner reports the copy done.
- ``TierRelease(owner, loaded_keys, stored_keys, failed_keys)``: loads done (unpin), stores done
  or failed; usually published without a reply subject (asked as a request, the tier answers
  ``TierJobDone`` naming the stores that became readable).

- ``TierRenew(owner, keys)`` (no reply): the owner still holds these pins and pending stores.

An owner is one engine core incarnation (``engine_id.incarnation``). Every pin and pending store
has a lease that ``TierRenew`` (sent every few seconds while the owner holds anything) extends;
a tier frees what was not renewed in time, so a dead engine core never leaks slots and a live
one never loses a slot it will still copy to or from.
"""

from __future__ import annotations

import msgspec

DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}


class KVLayout(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """The KV cache geometry an offloaded chunk has; equal layouts can share chunks.

    A slot holds ``tp_size`` parts, one per tensor-parallel rank, each ``[layer][k|v]
    [block_in_chunk][block_size, num_kv_heads, head_dim]`` (token-major, as the rank's cache
    has it). A ``canonical`` layout describes the chunk instead of the deployment that wrote
    it: one part (``tp_size`` 1) of every KV head of the model (``num_kv_heads`` is the
    model's), ``[layer][k|v][block_in_chunk][kv_head][block_size, head_dim]`` in global head
    order (head-major: a rank's heads are one contiguous run per layer, k|v and block;
    ``workers.kv_canonical``). Its bytes are the same whatever tensor-parallel size wrote
    them, so deployments of one model at TP=1 and TP=2 have equal canonical layouts."""

    model_tag: str  # names the model and its KV format (also a directory name of the fs tier)
    num_layers: int
    block_size: int
    num_kv_heads: int  # per part: a rank's, or the model's (canonical)
    head_dim: int
    dtype: str
    tp_size: int  # parts per slot: the tensor-parallel size, or 1 (canonical)
    blocks_per_chunk: int
    canonical: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(
                f"KV dtype must be one of {', '.join(DTYPE_SIZES)}, got {self.dtype!r}"
            )
        if self.canonical and self.tp_size != 1:
            raise ValueError(f"a canonical KV layout has one part (tp_size 1), not {self.tp_size}")
        for name in (
            "num_layers",
            "block_size",
            "num_kv_heads",
            "head_dim",
            "tp_size",
            "blocks_per_chunk",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"KV layout {name} must be positive, got {getattr(self, name)}")

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def rank_block_bytes(self) -> int:
        """K and V of one block, every layer, one part (a rank's, or every head: canonical)."""
        return (
            2
            * self.num_layers
            * self.block_size
            * self.num_kv_heads
            * self.head_dim
            * (self.itemsize)
        )

    @property
    def rank_chunk_bytes(self) -> int:
        return self.blocks_per_chunk * self.rank_block_bytes

    @property
    def slot_bytes(self) -> int:
        """One chunk, every part."""
        return self.tp_size * self.rank_chunk_bytes


class RegionRef(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """A CPU tier's shared-memory region: a file every process on the host can map.

    ``generation`` changes when the tier restarts (a new region, empty); a transfer naming an
    old generation is refused by a worker that cannot map it any more."""

    path: str
    generation: str
    num_slots: int
    layout: KVLayout


class KVLoad(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Copy region slots into one request's blocks before the step's forward pass."""

    req_id: str
    block_ids: list[int]
    slot_ids: list[int]  # co-indexed with block_ids
    block_offsets: list[int]  # each block's index within its slot's chunk


class KVStore(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Copy blocks whose KV an earlier step wrote into region slots."""

    job_id: int
    block_ids: list[int]
    slot_ids: list[int]
    block_offsets: list[int]


class KVTransfers(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A step's copies between the workers' KV cache and one region: loads run before the
    forward pass, stores before it too (their blocks were written by steps already landed)."""

    region: RegionRef
    loads: list[KVLoad] = []
    stores: list[KVStore] = []


class KVTransferResult(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What failed of a step's transfers (``StepResult.kv_transfer``); the rest succeeded. A
    request whose load failed was left out of the forward pass (it is recomputed)."""

    failed_load_req_ids: list[str] = []
    failed_store_job_ids: list[int] = []
    num_load_bytes: int = 0
    num_store_bytes: int = 0
    load_time_s: float = 0.0
    store_time_s: float = 0.0
    # Remote prefills' KV pulled (``ExecuteStep.kv_pulls``): a failed pull leaves its request
    # out of the step, as a failed load does.
    failed_pull_req_ids: list[str] = []
    num_pull_bytes: int = 0
    pull_time_s: float = 0.0


# ----- engine core → CPU tier


class TierAttach(msgspec.Struct, tag="attach", array_like=True, omit_defaults=True):
    layout: KVLayout
    create: bool = True  # False: a CPU tier without a region yet refuses (makes none)


class TierLookup(msgspec.Struct, tag="lookup", array_like=True, omit_defaults=True):
    """Which leading ``keys`` can ``owner`` load? Answered with ``TierLookupReply`` once, within
    the tier's promote budget: no RETRY comes back. Keys another lookup is promoting are waited
    for (each chunk is promoted once) and pinned for this owner too; keys an engine core is still
    storing are not (they end the run, counted as pending)."""

    owner: str
    keys: list[bytes]  # a request's chunk keys in prefix order
    tiers: list[str] | None = None  # the tier types it may load from (None: all)


class TierPrepareStore(msgspec.Struct, tag="prepare_store", array_like=True, omit_defaults=True):
    owner: str
    keys: list[bytes]


class TierRelease(msgspec.Struct, tag="release", array_like=True, omit_defaults=True):
    owner: str
    loaded_keys: list[bytes] = []  # unpin (one pin each)
    stored_keys: list[bytes] = []  # copies done: readable now
    failed_keys: list[bytes] = []  # copies failed: drop them
    generation: str = ""  # the region these were granted in; another one's are ignored


class TierRenew(msgspec.Struct, tag="renew", array_like=True, omit_defaults=True):
    owner: str
    keys: list[bytes] = []  # one entry per pin or pending store ``owner`` still holds
    generation: str = ""  # the region they were granted in; another one's are ignored


# ----- CPU tier → secondary tier (same host: the region is shared)


class TierCascade(msgspec.Struct, tag="cascade", array_like=True, omit_defaults=True):
    """Write these (pinned) slots of the region as chunks; answered with ``TierJobDone``."""

    region: RegionRef
    keys: list[bytes]
    slot_ids: list[int]
    deadline: float = 0.0  # time.time() after which the slots may be reused: touch none then


class TierPromote(msgspec.Struct, tag="promote", array_like=True, omit_defaults=True):
    """Read the leading keys held into these (reserved) slots; answered with ``TierJobDone``
    naming the keys read (a prefix of ``keys``: reading stops at the first one missing or
    corrupt)."""

    region: RegionRef
    keys: list[bytes]
    slot_ids: list[int]
    deadline: float = 0.0  # time.time() after which the slots may be reused: touch none then


class TierJobDone(msgspec.Struct, tag="job_done", array_like=True, omit_defaults=True):
    done_keys: list[bytes] = []
    failed_keys: list[bytes] = []


# ----- replies


class TierAttached(msgspec.Struct, tag="attached", array_like=True, omit_defaults=True):
    region: RegionRef


class TierLookupReply(msgspec.Struct, tag="lookup_reply", array_like=True, omit_defaults=True):
    """``slot_ids`` of the leading keys held, pinned (promotions in flight already waited for);
    ``num_pending``: keys after them still being written, by an engine core's store or by a
    promotion that outlasted the lookup's budget (a later lookup may find them)."""

    generation: str
    slot_ids: list[int] = []
    num_pending: int = 0
    usage: float = 0.0  # the tier's slots in use, 0.0 to 1.0


class TierStoreSlots(msgspec.Struct, tag="store_slots", array_like=True, omit_defaults=True):
    """Where to copy ``keys`` (co-indexed ``slot_ids``); keys of the offer not named are held
    already or held back (``store_threshold``). ``accepted=False``: no room (nothing changed)."""

    generation: str
    keys: list[bytes] = []
    slot_ids: list[int] = []
    accepted: bool = True
    usage: float = 0.0


class TierHeld(msgspec.Struct, tag="held", array_like=True, omit_defaults=True):
    """A secondary tier's answer to ``TierLookup``: how many leading keys it holds."""

    num_leading: int


class SecondaryAttached(
    msgspec.Struct, tag="secondary_attached", array_like=True, omit_defaults=True
):
    """A secondary tier's answer to ``TierAttach``: how many chunks of this layout it holds
    (a filesystem tier finds them on disk at the first attach) and its usage, 0.0 to 1.0."""

    num_chunks: int
    usage: float = 0.0


class TierError(msgspec.Struct, tag="tier_error", array_like=True, omit_defaults=True):
    message: str


TierInbound = TierAttach | TierLookup | TierPrepareStore | TierRelease | TierRenew
SecondaryInbound = TierAttach | TierCascade | TierPromote | TierLookup
TierReply = (
    TierAttached
    | TierLookupReply
    | TierStoreSlots
    | TierHeld
    | TierJobDone
    | SecondaryAttached
    | TierError
)
