"""The KV offload group of the configuration (``KVTransferConfig``, its ``secondary_tiers``
entries) and its translation from vLLM's spelling: ``--kv-transfer-config`` JSON with the
``OffloadingConnector``, or the ``--kv-offloading-size`` shortcut."""

from __future__ import annotations

from typing import Any

import msgspec

from shoal.config.disaggregation import VLLM_KV_ROLES
from shoal.config.validation import one_of as _one_of
from shoal.config.validation import positive as _positive
from shoal.config.validation import require as _require


class SecondaryTier(
    msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True, tag_field="type"
):
    """A ``secondary_tiers`` entry: a tier behind the CPU tier; its ``type`` is its tag."""

    @property
    def type(self) -> str:
        return str(self.__struct_config__.tag)

    @property
    def takes_stores(self) -> bool:
        """Whether the CPU tier cascades its stores to this tier (a peer tier keeps none)."""
        return True


class StoringTier(SecondaryTier, kw_only=True, frozen=True):
    """A secondary tier that keeps its own copy of every chunk cascaded to it."""

    bytes_to_use: int = 8 << 30  # byte budget; the oldest chunks are evicted past it

    def __post_init__(self) -> None:
        _require(
            self.bytes_to_use >= 1,
            "secondary_tiers[].bytes_to_use",
            f"must be a positive integer, got {self.bytes_to_use}",
        )


class FsTierConfig(StoringTier, frozen=True, tag="fs"):
    """A filesystem tier (type ``fs``) on the CPU tier's host."""

    path: str  # root directory; chunks go under <path>/<model tag>/tp<size>_r<rank>/

    def __post_init__(self) -> None:
        _require(bool(self.path), "secondary_tiers[].path", "must be a directory path")
        super().__post_init__()


class ObjTierConfig(StoringTier, frozen=True, tag="obj"):
    """An object-store tier (type ``obj``): the bus's object store (the JetStream Object Store
    of the deployment's NATS, reachable from every host; the broker's own in memory)."""

    bucket: str = ""  # "": shoal_kv_<namespace>

    def __post_init__(self) -> None:
        _require(
            all(c.isascii() and (c.isalnum() or c in "_-") for c in self.bucket),
            "secondary_tiers[].bucket",
            f"must be letters, digits, '_' or '-', got {self.bucket!r}",
        )
        super().__post_init__()


class P2PTierConfig(SecondaryTier, frozen=True, tag="p2p"):
    """A peer-to-peer tier (type ``p2p``): a miss here is looked up in the CPU tiers of the
    other hosts (their p2p tier actors answer) and pulled from the one holding the longest
    prefix. It stores nothing of its own: the CPU tier cascades nothing to it."""

    peer_lookup_timeout_s: float = 0.25  # one lookup round waits this long for the peers
    transfer_window: int = 4  # chunk reads over the bus in flight, per promotion
    read_timeout_s: float = 1.0  # one chunk read from a peer
    direct_transfer: bool = True  # chunks over a TCP stream from peer to peer where it connects
    data_host: str = ""  # the stream's address (bound and given to peers); "": this host's name
    data_port: int = 0  # its port (0: any free one)

    @property
    def takes_stores(self) -> bool:
        return False

    def __post_init__(self) -> None:
        for name in ("peer_lookup_timeout_s", "read_timeout_s"):
            value = getattr(self, name)
            _require(value > 0, f"secondary_tiers[].{name}", f"must be positive, got {value}")
        _require(
            self.transfer_window >= 1,
            "secondary_tiers[].transfer_window",
            f"must be a positive integer, got {self.transfer_window}",
        )
        _require(
            0 <= self.data_port < 65536,
            "secondary_tiers[].data_port",
            f"must be a TCP port (0: any), got {self.data_port}",
        )


SecondaryTierConfig = FsTierConfig | ObjTierConfig | P2PTierConfig
SECONDARY_TIER_TYPES = ("fs", "obj", "p2p")


class BackpressureConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Backpressure on a slow secondary tier (``kv_connector_extra_config.backpressure``;
    ``tiers/books/backpressure.py``): stores to a tier whose moving average of store latency passed
    ``high_water_s`` (or that failed ``failure_streak`` stores in a row) are dropped, with a
    probability growing up to ``max_drop_probability``, until the average falls below
    ``low_water_s``; loads are never dropped."""

    ema_alpha: float = 0.2  # weight of the newest store in the moving average
    high_water_s: float = 2.0
    low_water_s: float = 0.5
    max_drop_probability: float = 0.9  # the stores let through keep measuring the tier
    failure_streak: int = 3
    probe_interval_s: float = 5.0  # a store always goes through after this long unmeasured

    def __post_init__(self) -> None:
        _require(0 < self.ema_alpha <= 1, "backpressure.ema_alpha", "must be in (0, 1]")
        _require(
            0 <= self.low_water_s < self.high_water_s,
            "backpressure.low_water_s",
            f"must be >= 0 and below high_water_s ({self.high_water_s}), got {self.low_water_s}",
        )
        _require(
            0 <= self.max_drop_probability < 1,
            "backpressure.max_drop_probability",
            "must be in [0, 1): stores let through measure the tier",
        )
        _require(self.probe_interval_s > 0, "backpressure.probe_interval_s", "must be positive")
        _require(self.failure_streak >= 1, "backpressure.failure_streak", "must be at least 1")


class KVTransferConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """KV offload (vLLM's ``--kv-transfer-config`` with ``OffloadingConnector``): full KV chunks
    are stored in a CPU tier actor (shared memory on the workers' host) and, behind it, in
    ``secondary_tiers``; a request whose prefix is there loads it instead of recomputing.
    ``kv_connector=None``: off."""

    kv_connector: str | None = None  # "OffloadingConnector" turns offload on
    kv_role: str = "kv_both"
    cpu_bytes_to_use: int = 0  # the CPU tier's shared-memory bytes (all ranks together)
    eviction_policy: str = "lru"  # lru | arc
    blocks_per_chunk: int = 1  # KV blocks per offloaded chunk (vLLM's extra_config block_size
    # is blocks_per_chunk * the KV block size)
    store_threshold: int = 0  # store a chunk only once offered this many times (< 2: always)
    max_tracker_size: int = 64_000
    offload_prompt_only: bool = True
    offload_policy: str = "chunk_level"  # chunk_level: newly computed chunks; request_level: all
    secondary_tiers: tuple[FsTierConfig | ObjTierConfig | P2PTierConfig, ...] = ()
    # shoal's own: the CPU tier actor's id, how long a lookup may take before the request
    # recomputes, and how many chunks may wait to be stored before more stores are dropped.
    cpu_tier_id: str = "kv-cpu"
    kv_lookup_timeout_s: float = 2.0
    max_pending_store_chunks: int = 1024
    backpressure: BackpressureConfig = msgspec.field(default_factory=BackpressureConfig)
    # Chunks in a layout independent of the tensor-parallel size (``KVLayout.canonical``): a
    # chunk stored at TP=2 loads at TP=1 and back.
    canonical_layout: bool = False

    def __post_init__(self) -> None:
        _one_of(str(self.kv_connector), ("None", "OffloadingConnector"), "kv_connector")
        _one_of(self.kv_role, ("kv_both",), "kv_role")
        _one_of(self.eviction_policy, ("lru", "arc"), "eviction_policy")
        _one_of(self.offload_policy, ("chunk_level", "request_level"), "offload_policy")
        _positive(self, "blocks_per_chunk", "max_tracker_size", "max_pending_store_chunks")
        _require(
            self.cpu_bytes_to_use >= 0,
            "cpu_bytes_to_use",
            f"must be non-negative, got {self.cpu_bytes_to_use}",
        )
        _require(
            self.kv_connector is None or self.cpu_bytes_to_use > 0,
            "cpu_bytes_to_use",
            "is required (a positive byte count) with the OffloadingConnector",
        )
        _require(
            self.store_threshold >= 0,
            "store_threshold",
            f"must be non-negative, got {self.store_threshold}",
        )
        _require(
            self.kv_lookup_timeout_s > 0,
            "kv_lookup_timeout_s",
            f"must be positive, got {self.kv_lookup_timeout_s}",
        )
        peers = [tier for tier in self.secondary_tiers if isinstance(tier, P2PTierConfig)]
        _require(
            len(peers) <= 1,
            "secondary_tiers",
            "may hold one p2p tier (every peer is asked at once)",
        )
        # the CPU tier waits kv_lookup_timeout_s / 4 for one secondary's answer: the round,
        # the peers' own CPU tiers and the answers fit in it
        _require(
            not peers or peers[0].peer_lookup_timeout_s <= self.kv_lookup_timeout_s / 8,
            "secondary_tiers[].peer_lookup_timeout_s",
            f"must be at most kv_lookup_timeout_s / 8 ({self.kv_lookup_timeout_s / 8:g} s)",
        )

    @property
    def enabled(self) -> bool:
        return self.kv_connector is not None

    @property
    def secondary_tier_ids(self) -> list[str]:
        """Actor ids of the ``secondary_tiers``, in order (``<cpu_tier_id>-<type><i>``)."""
        return [f"{self.cpu_tier_id}-{t.type}{i}" for i, t in enumerate(self.secondary_tiers)]


OFFLOADING_CONNECTOR = "OffloadingConnector"
# vLLM's connectors for disaggregated prefill: shoal's own handover stands in for them.
HANDOVER_CONNECTORS = ("NixlConnector",)
OFFLOADING_SPECS = ("CPUOffloadingSpec", "TieringOffloadingSpec")  # CPU tier, + secondary tiers
OFFLOADING_BACKENDS = ("native",)
KV_TRANSFER_KEYS = ("kv_connector", "kv_role", "kv_connector_extra_config")
KV_TRANSFER_UNSUPPORTED = (
    "engine_id", "kv_buffer_device", "kv_buffer_size", "kv_rank", "kv_parallel_size", "kv_ip",
    "kv_port", "kv_connector_module_path", "kv_load_failure_policy", "enable_permute_local_kv",
)  # fmt: skip
EXTRA_KEYS = (
    "spec_name", "block_size",
    *(f for f in KVTransferConfig.__struct_fields__ if f not in ("kv_connector", "kv_role")),
)  # fmt: skip
EXTRA_UNSUPPORTED = (
    "cache_policy_module_path", "tier_poll_interval_s",
    "sync_load_budget_bytes", "self_describing_kv_events", "spec_module_path",
)  # fmt: skip
FS_UNSUPPORTED = ("n_read_threads", "n_write_threads")
# vLLM's obj tier is S3 through NIXL; shoal's is the NATS deployment's own Object Store.
OBJ_TIER_UNSUPPORTED = (
    "endpoint_override",
    "access_key",
    "secret_key",
    "session_token",
    "region",
    "scheme",
    "ca_bundle",
)
# vLLM's p2p tier is a ZMQ side channel plus NIXL; shoal's peers meet on the bus.
P2P_TIER_UNSUPPORTED = ("host", "port", "unbound_store_timeout_s")
EXTRA = "kv_connector_extra_config"


def _check_keys(
    value: Any, where: str, known: tuple[str, ...], unsupported: tuple[str, ...]
) -> None:
    """``value`` is a JSON object whose keys are all ``known``; else a ``ValueError`` naming the
    first offending key."""
    _require(isinstance(value, dict), where, f"must be a JSON object, got {value!r}")
    for key in value:
        _require(key not in unsupported, f"{where}.{key}", "is not supported by shoal")
        _require(key in known, f"{where}.{key}", f"is an unknown key; known: {', '.join(known)}")


def kv_offload_options(
    kv_transfer_config: dict[str, Any] | KVTransferConfig | None,
    kv_offloading_size: float | None,
    kv_offloading_backend: str = "native",
    *,
    cache_block_size: int = 16,
) -> dict[str, Any]:
    """Flat ``KVTransferConfig`` options from vLLM's ``--kv-transfer-config`` JSON or its
    shortcut ``--kv-offloading-size`` (GiB of CPU tier; the two conflict); ``{}`` for neither."""
    _require(
        kv_offloading_backend in OFFLOADING_BACKENDS,
        "kv_offloading_backend",
        f"{kv_offloading_backend!r} is not supported; shoal has only 'native'",
    )
    if kv_offloading_size is None:
        if kv_transfer_config is None:
            return {}
        return kv_transfer_options(kv_transfer_config, cache_block_size)
    _require(
        kv_transfer_config is None,
        "kv_offloading_size",
        "conflicts with kv_transfer_config: give one of them",
    )
    _require(
        kv_offloading_size > 0,
        "kv_offloading_size",
        f"must be a positive number of GiB, got {kv_offloading_size}",
    )
    size = int(kv_offloading_size * (1 << 30))
    return {"kv_connector": OFFLOADING_CONNECTOR, "kv_role": "kv_both", "cpu_bytes_to_use": size}


def kv_transfer_options(
    value: dict[str, Any] | KVTransferConfig, cache_block_size: int
) -> dict[str, Any]:
    """Flat options from vLLM's ``{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
    "kv_connector_extra_config": {...}}``: the extra config's keys are the group's fields, but
    ``block_size`` (tokens per chunk, a multiple of ``cache_block_size``) becomes
    ``blocks_per_chunk``, ``spec_name`` is checked and dropped, and ``secondary_tiers`` entries
    become ``FsTierConfig`` (vLLM's ``root_dir`` is ``path``) or ``ObjTierConfig``."""
    if isinstance(value, KVTransferConfig):
        return msgspec.structs.asdict(value)
    _check_keys(value, "kv_transfer_config", KV_TRANSFER_KEYS, KV_TRANSFER_UNSUPPORTED)
    connector = value.get("kv_connector")
    _require(connector is not None, "kv_transfer_config.kv_connector", "is required")
    if connector in HANDOVER_CONNECTORS:
        return _handover_options(value)
    _require(
        connector == OFFLOADING_CONNECTOR,
        "kv_transfer_config.kv_connector",
        f"{connector!r} is not supported; shoal has {OFFLOADING_CONNECTOR!r} (KV offload) and "
        f"{', '.join(map(repr, HANDOVER_CONNECTORS))} (disaggregated prefill)",
    )
    extra = value.get(EXTRA, {})
    _check_keys(extra, EXTRA, EXTRA_KEYS, EXTRA_UNSUPPORTED)
    spec = extra.get("spec_name", OFFLOADING_SPECS[0])
    _require(spec in OFFLOADING_SPECS, f"{EXTRA}.spec_name", f"{spec!r} is not supported")
    _require(
        "cpu_bytes_to_use" in extra,
        f"{EXTRA}.cpu_bytes_to_use",
        "is required: the CPU tier's bytes, all workers together",
    )
    options = {k: v for k, v in extra.items() if k not in ("spec_name", "block_size")}
    options.update(kv_connector=connector, kv_role=value.get("kv_role", "kv_both"))
    if "block_size" in extra:
        options["blocks_per_chunk"] = _blocks_per_chunk(extra, cache_block_size)
    tiers = options.get("secondary_tiers", [])
    _require(isinstance(tiers, list), f"{EXTRA}.secondary_tiers", "must be a JSON list")
    options["secondary_tiers"] = [_secondary_tier(tier, i) for i, tier in enumerate(tiers)]
    try:
        group = msgspec.convert(options, KVTransferConfig)
    except msgspec.ValidationError as exc:  # a wrong type, or the group's own checks
        raise ValueError(f"kv_transfer_config: {str(exc).replace('`$.', f'`{EXTRA}.')}") from None
    return msgspec.structs.asdict(group)


def _handover_options(value: dict[str, Any]) -> dict[str, Any]:
    """Disaggregated prefill in vLLM's spelling: ``{"kv_connector": "NixlConnector", "kv_role":
    "kv_producer"}`` is ``disagg_role`` prefill (``kv_consumer``: decode, ``kv_both``: both);
    shoal's own KV handover takes the connector's place (``config.disaggregation``)."""
    role = value.get("kv_role", "kv_both")
    _require(
        role in VLLM_KV_ROLES,
        "kv_transfer_config.kv_role",
        f"must be one of {', '.join(VLLM_KV_ROLES)}, got {role!r}",
    )
    _require(
        not value.get(EXTRA),
        f"kv_transfer_config.{EXTRA}",
        f"is not supported with {value['kv_connector']!r}: shoal's handover takes no options here",
    )
    return {"disagg_role": VLLM_KV_ROLES[role]}


def _blocks_per_chunk(extra: dict[str, Any], cache_block_size: int) -> int:
    _require(
        "blocks_per_chunk" not in extra,
        f"{EXTRA}.block_size",
        "and blocks_per_chunk are mutually exclusive: give one",
    )
    tokens = extra["block_size"]
    _require(
        type(tokens) is int and tokens > 0 and tokens % cache_block_size == 0,
        f"{EXTRA}.block_size",
        f"must be a positive multiple of the KV cache block_size ({cache_block_size}), "
        f"got {tokens!r}",
    )
    return int(tokens) // cache_block_size


def _secondary_tier(tier: Any, index: int) -> Any:
    """One ``secondary_tiers`` entry, checked; vLLM's ``root_dir`` (fs) renamed ``path``."""
    where = f"{EXTRA}.secondary_tiers[{index}]"
    _require(isinstance(tier, dict), where, f"must be a JSON object, got {tier!r}")
    kind = tier.get("type")
    _require(kind is not None, f"{where}.type", "is required ('fs', 'obj' or 'p2p')")
    _require(
        kind in SECONDARY_TIER_TYPES,
        f"{where}.type",
        f"{kind!r} is not supported; shoal has {', '.join(map(repr, SECONDARY_TIER_TYPES))}",
    )
    if kind == "obj":
        _check_keys(tier, where, ("type", *ObjTierConfig.__struct_fields__), OBJ_TIER_UNSUPPORTED)
        return tier
    if kind == "p2p":
        _check_keys(tier, where, ("type", *P2PTierConfig.__struct_fields__), P2P_TIER_UNSUPPORTED)
        return tier
    _check_keys(tier, where, ("type", *FsTierConfig.__struct_fields__, "root_dir"), FS_UNSUPPORTED)
    if "root_dir" in tier:
        _require("path" not in tier, f"{where}.root_dir", "and path name the same: give one")
        tier = {("path" if k == "root_dir" else k): v for k, v in tier.items()}
    return tier
