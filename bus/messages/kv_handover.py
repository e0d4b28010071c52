"""Disaggregated prefill's data plane messages (issue 33): where a prefill engine core's
workers keep their KV cache, and the pulls a decode engine core's step carries.

A prefill-role worker on the CPU keeps its paged KV cache in one shared-memory file
(``workers.kv_export``) that every process of its host can map: ``KVExportRef`` names it. The
prefill engine core puts its workers' refs (one per tensor-parallel rank) in the
``KVTransferParams`` of a finished prefill; the decode engine core admits the request with those
params and rides a ``KVPull`` per request on a step: its workers copy the held blocks straight
out of the prefill workers' files into their own cache before the forward pass (on another host:
through the prefill worker's TCP server, ``workers.kv_export_server``), each rank the KV heads it
holds, from whichever prefill ranks hold them (the two sides' tensor-parallel sizes may differ).
No KV bytes travel on the bus.
"""

from __future__ import annotations

import msgspec


class KVExportRef(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """One worker's exported KV cache: ``[layer][k|v][block][block_size, kv_head, head_dim]``
    after a one-page header, in the file ``path`` on ``host``.

    The header holds ``token`` (random per worker process: a mapping of anything else is
    refused) and an epoch that the worker advances whenever it forgets its requests: a pull
    reads it before and after its copy and fails unless both equal ``epoch``, so KV of an
    engine core life that has ended is never taken for the held blocks."""

    host: str  # where ``path`` can be opened (boot id and host name)
    path: str
    token: str
    epoch: int
    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int  # this rank's
    head_dim: int
    dtype: str
    tp_rank: int
    tp_size: int
    total_kv_heads: int  # the model's
    address: str = ""  # host:port of its worker's server for readers on other hosts ("": none)


class KVPull(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Copy a remote prefill's held blocks into one request's blocks before the forward pass:
    ``remote_block_ids[i]`` of the prefill workers' caches (``source``, one ref per prefill
    rank) into ``block_ids[i]``."""

    req_id: str
    block_ids: list[int]
    remote_block_ids: list[int]
    source: list[KVExportRef]
