"""KV offload tiers.

The pure protocol, importable by the engine core (no I/O, no torch): ``keys`` (offload and chunk
keys from block hashes), ``manager`` (one tier's ``OffloadManager``), ``policies`` (eviction
policies by name: ``lru``, ``arc``), ``store_filter`` (``store_threshold``). Tier actors, which
own bytes and talk over the bus, come beside them and are reached by messages only.
"""
