"""The bus's two transports: ``memory`` (one process, NATS's semantics) and ``nats_bus`` (a NATS
server through nats-py), with what both share (chunking above a payload limit, per-subscription
dispatch) and the in-memory equivalents of JetStream's streams, buckets and object stores."""
