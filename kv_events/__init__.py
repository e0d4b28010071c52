"""Prefix routing's KV events on the bus, shared by their sources and readers: the publisher an
engine core and an offload tier each send their batches through (``publisher``) and the
JetStream stream that keeps them for clients to replay (``stream``)."""
