"""KV offload tiers, a folder per role:

- ``books/``: the pure protocol and bookkeeping, importable by the engine core (no I/O, no torch;
  wire schemas only): ``keys`` (offload and chunk keys from block hashes), ``manager`` (one
  tier's ``OffloadManager``), ``policies`` (eviction policies by name: ``lru``, ``arc``),
  ``store_filter`` (``store_threshold``), ``owners`` and ``cpu_books`` (the CPU tier's leases),
  ``backpressure`` (a slow secondary's), ``p2p_sessions`` (the p2p tier's pins and plans).
- ``cpu/``: the CPU tier, the gateway tier of a host: its actor, its shared-memory region (and
  the mapped regions the other tiers keep), its links to secondary tiers, promotion waits.
- ``secondary/``: the tiers behind a CPU tier that store chunks: the shared secondary actor, the
  filesystem and object-store tiers and their chunk format.
- ``p2p/``: the peer-to-peer tier: its actor, the direct TCP channel, pulling and serving.
- ``tier_events``: every tier's KV events, for prefix routing.

Tier actors own bytes and talk over the bus; they are reached by messages only.
"""
