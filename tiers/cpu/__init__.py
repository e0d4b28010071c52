"""The CPU tier: a host's gateway tier of KV offload (actor, shared-memory region, the regions
other tiers map, links to the secondary tiers behind it, lookups waiting for promotions)."""
