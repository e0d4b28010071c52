"""The offload tiers' pure books: keys, the manager and its eviction policies, store filters,
owners' leases, backpressure and the p2p tier's sessions. No I/O, no torch, no transport:
the engine core imports them (``tests/unit/test_package_rules.py`` holds the folder to it)."""
