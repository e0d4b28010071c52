"""Disaggregated prefill between hosts: a prefill worker serves reads of its exported KV cache
(``workers.kv_export``) over TCP, and a decode worker on another host reads held blocks through
it (``fetch_blocks``). The bus carries no KV bytes here either.

A read (decode → prefill): a 4-byte big-endian length and a msgpack ``KVRead`` naming the cache
(its token), the epoch the ref was made in, the blocks and the heads wanted. The server gathers
them (``[layer][k|v][block][block_size, head, head_dim]``, contiguous), checks the epoch before
and after, and answers with a ``KVReadReply`` (ok or why not, the payload's length and xxh3-128
digest) and then the payload. The reader checks the length and the digest: a short, damaged or
refused read fails the pull (the request is recomputed), never a wrong byte. The token is the
capability: a read naming another cache is refused.

The server runs on threads of its own in the worker process (a read gathers with torch, which
releases the GIL); the blocks it reads are held by the prefill engine core, so no step writes
them meanwhile, and the epoch check covers a new engine core life.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import struct
import threading

import msgspec
import torch
import xxhash

from shoal.bus.messages.kv_handover import KVExportRef
from shoal.workers.kv_export import ExportedKVCache, ExportUnavailable
from shoal.workers.region_views import TORCH_DTYPES

log = logging.getLogger(__name__)

_LENGTH = struct.Struct(">I")
MAX_REQUEST_BYTES = 1 << 22
READ_TIMEOUT_S = 30.0


class KVRead(msgspec.Struct, array_like=True):
    token: str
    epoch: int
    block_ids: list[int]
    head_start: int
    num_heads: int


class KVReadReply(msgspec.Struct, array_like=True):
    ok: bool
    message: str = ""
    num_bytes: int = 0
    digest: bytes = b""


def gather(export: ExportedKVCache, read: KVRead) -> torch.Tensor:
    """The requested blocks and heads of every layer, K and V: ``[L, 2, n, block_size, h, D]``;
    ``ValueError`` for ids or heads outside the cache."""
    cache = export.kv_cache
    num_blocks, _, num_heads, _ = cache.k[0].shape
    if any(not 0 <= b < num_blocks for b in read.block_ids):
        raise ValueError("a block id outside the cache")
    if read.num_heads < 1 or not 0 <= read.head_start <= num_heads - read.num_heads:
        raise ValueError(f"heads {read.head_start}+{read.num_heads} outside {num_heads}")
    ids = torch.tensor(read.block_ids, dtype=torch.int64)
    heads = slice(read.head_start, read.head_start + read.num_heads)
    layers = [
        torch.stack((k.index_select(0, ids)[:, :, heads], v.index_select(0, ids)[:, :, heads]))
        for k, v in zip(cache.k, cache.v, strict=True)
    ]
    return torch.stack(layers).contiguous()


def answer(export: ExportedKVCache, read: KVRead) -> tuple[KVReadReply, bytes]:
    """The reply to ``read`` and its payload."""
    if read.token != export.token.hex():
        return KVReadReply(False, "not this worker's KV cache"), b""
    if read.epoch != export.epoch:
        return KVReadReply(False, "the held KV is gone (a new epoch)"), b""
    try:
        payload = gather(export, read).view(torch.uint8).numpy().tobytes()
    except ValueError as exc:
        return KVReadReply(False, str(exc)), b""
    if read.epoch != export.epoch:
        return KVReadReply(False, "the held KV went during the read"), b""
    return KVReadReply(True, "", len(payload), xxhash.xxh3_128_digest(payload)), payload


class KVExportServer:
    """Serves ``export`` on ``bind_host:port`` (0: any free port); ``address`` is what decode
    workers connect to."""

    def __init__(self, export: ExportedKVCache, bind_host: str, advertise_host: str, port: int = 0):
        export_ = export

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                serve_one(self.request, export_)

        self._server = socketserver.ThreadingTCPServer((bind_host, port), Handler)
        self._server.daemon_threads = True
        self.address = f"{advertise_host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="kv-export-server", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve_one(conn: socket.socket, export: ExportedKVCache) -> None:
    """Answer the reads of one connection until it closes."""
    conn.settimeout(READ_TIMEOUT_S)
    try:
        while True:
            head = _recv_exactly(conn, _LENGTH.size, allow_eof=True)
            if not head:
                return
            (length,) = _LENGTH.unpack(head)
            if length > MAX_REQUEST_BYTES:
                return
            try:
                read = msgspec.msgpack.decode(_recv_exactly(conn, length), type=KVRead)
                reply, payload = answer(export, read)
            except msgspec.DecodeError as exc:
                reply, payload = KVReadReply(False, f"bad read: {exc}"), b""
            encoded = msgspec.msgpack.encode(reply)
            conn.sendall(_LENGTH.pack(len(encoded)) + encoded)
            if payload:
                conn.sendall(payload)
    except OSError as exc:
        log.debug("KV export connection ended: %r", exc)


def fetch_blocks(
    ref: KVExportRef, block_ids: list[int], head_start: int, num_heads: int
) -> torch.Tensor:
    """Read blocks of the cache ``ref`` names from its worker's server: ``[L, 2, n,
    block_size, num_heads, D]``; ``ExportUnavailable`` when it cannot be read whole and intact."""
    if not ref.address:
        raise ExportUnavailable(f"KV cache of rank {ref.tp_rank} is on another host, unserved")
    host, _, port = ref.address.rpartition(":")
    read = KVRead(ref.token, ref.epoch, block_ids, head_start, num_heads)
    encoded = msgspec.msgpack.encode(read)
    try:
        with socket.create_connection((host, int(port)), timeout=READ_TIMEOUT_S) as conn:
            conn.sendall(_LENGTH.pack(len(encoded)) + encoded)
            (length,) = _LENGTH.unpack(_recv_exactly(conn, _LENGTH.size))
            reply = msgspec.msgpack.decode(_recv_exactly(conn, length), type=KVReadReply)
            if not reply.ok:
                raise ExportUnavailable(f"rank {ref.tp_rank} refused the read: {reply.message}")
            payload = bytearray(reply.num_bytes)
            _recv_into(conn, memoryview(payload))
    except (OSError, ValueError, msgspec.DecodeError) as exc:
        raise ExportUnavailable(f"KV read from {ref.address} failed: {exc!r}") from exc
    if xxhash.xxh3_128_digest(payload) != reply.digest:
        raise ExportUnavailable(f"KV read from {ref.address} arrived damaged (digest)")
    dtype = TORCH_DTYPES[ref.dtype]
    shape = (ref.num_layers, 2, len(block_ids), ref.block_size, num_heads, ref.head_dim)
    blocks = torch.frombuffer(payload, dtype=torch.uint8).view(dtype)
    if blocks.numel() != torch.Size(shape).numel():
        raise ExportUnavailable(f"KV read from {ref.address} has {blocks.numel()} values")
    return blocks.view(shape)


def _recv_exactly(conn: socket.socket, n: int, allow_eof: bool = False) -> bytes:
    data = bytearray(n)
    got = _recv_into(conn, memoryview(data), allow_eof)
    return bytes(data[:got])


def _recv_into(conn: socket.socket, view: memoryview, allow_eof: bool = False) -> int:
    got = 0
    while got < len(view):
        num = conn.recv_into(view[got:])
        if num == 0:
            if allow_eof and got == 0:
                return 0
            raise ConnectionError(f"stream closed after {got} of {len(view)} bytes")
        got += num
    return got
