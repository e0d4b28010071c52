"""Disaggregated prefill between hosts (``workers.kv_export_server``): a prefill worker's server
answers reads of its exported cache on loopback, and a decode rank whose views say it is on
another host pulls through it, head by head, with the same result as the shared-memory path;
reads that cannot be trusted (another cache's token, a new epoch, ids outside the cache, a
damaged payload, nobody listening) fail the pull, never land wrong bytes."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
import torch

from shoal.bus.messages.kv_handover import KVExportRef, KVPull
from shoal.workers import kv_export_server
from shoal.workers.kv_canonical import CanonicalMapping
from shoal.workers.kv_export import ExportUnavailable, ExportViews
from shoal.workers.kv_export_server import KVExportServer, fetch_blocks
from shoal.workers.kv_pull import run_kv_pulls
from tests.unit.test_kv_pull import (
    BLOCK_IDS,
    REMOTE_IDS,
    Export,
    PrefillSide,
    decode_cache,
    export,  # noqa: F401  (the fixture)
    landed,
    prefill_side,
    stacked,
)


@pytest.fixture
def served(export: Export) -> Iterator[tuple[PrefillSide, list[KVExportRef]]]:  # noqa: F811
    """A TP=2 prefill side of 4 KV heads, each rank served on loopback."""
    side = prefill_side(export, total_kv_heads=4, tp_size=2, dtype=torch.float32)
    servers = [KVExportServer(cache, "127.0.0.1", "127.0.0.1") for cache in side.exports]
    refs = [
        msgspec.structs.replace(ref, address=server.address)
        for ref, server in zip(side.refs(), servers, strict=True)
    ]
    yield side, refs
    for server in servers:
        server.close()


def elsewhere() -> ExportViews:
    """Views of a decode rank on another host: every source is read through its server."""
    views = ExportViews()
    views.host = "another-boot-id:another-host"
    return views


def test_a_decode_rank_on_another_host_pulls_every_head_through_the_servers(served) -> None:  # type: ignore[no-untyped-def]
    side, refs = served
    mine = CanonicalMapping.of(4, 1, 0)
    cache = decode_cache(mine, torch.float32)
    before = stacked(cache)
    outcome = run_kv_pulls(
        [KVPull("r", BLOCK_IDS, REMOTE_IDS, refs)], cache, mine=mine, views=elsewhere()
    )
    assert outcome.failed_req_ids == []
    assert torch.equal(stacked(cache), landed(before, side, mine, BLOCK_IDS, REMOTE_IDS))


def test_a_read_returns_the_blocks_and_heads_asked_for(served) -> None:  # type: ignore[no-untyped-def]
    side, refs = served
    blocks = fetch_blocks(refs[1], REMOTE_IDS, head_start=1, num_heads=1)
    # rank 1 holds the model's heads 2-3: its local head 1 is the model's head 3
    expected = side.model_kv[:, :, REMOTE_IDS, :, 3:4]
    assert torch.equal(blocks, expected)


@pytest.mark.parametrize(
    "spoil",
    [
        {"token": "00" * 16},  # another cache's
        {"epoch": 7},  # an engine core life that has ended
    ],
    ids=["token", "epoch"],
)
def test_a_read_the_server_cannot_vouch_for_is_refused(served, spoil) -> None:  # type: ignore[no-untyped-def]
    _, refs = served
    with pytest.raises(ExportUnavailable, match="refused"):
        fetch_blocks(msgspec.structs.replace(refs[0], **spoil), REMOTE_IDS, 0, 2)
    with pytest.raises(ExportUnavailable, match="refused"):
        fetch_blocks(refs[0], [99], 0, 2)  # outside the cache


def test_a_damaged_payload_fails_the_pull_and_writes_nothing(served, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    _, refs = served
    real = kv_export_server.answer

    def flip_a_byte(cache, read):  # type: ignore[no-untyped-def]
        reply, payload = real(cache, read)
        return reply, bytes([payload[0] ^ 1]) + payload[1:]

    monkeypatch.setattr(kv_export_server, "answer", flip_a_byte)
    mine = CanonicalMapping.of(4, 1, 0)
    cache = decode_cache(mine, torch.float32)
    before = stacked(cache)
    outcome = run_kv_pulls(
        [KVPull("r", BLOCK_IDS, REMOTE_IDS, refs)], cache, mine=mine, views=elsewhere()
    )
    assert outcome.failed_req_ids == ["r"]
    assert torch.equal(stacked(cache), before)


def test_nobody_listening_or_no_server_fails_the_pull(served) -> None:  # type: ignore[no-untyped-def]
    _, refs = served
    closed = msgspec.structs.replace(refs[0], address="127.0.0.1:1")
    with pytest.raises(ExportUnavailable):
        fetch_blocks(closed, REMOTE_IDS, 0, 2)
    with pytest.raises(ExportUnavailable, match="unserved"):
        fetch_blocks(msgspec.structs.replace(refs[0], address=""), REMOTE_IDS, 0, 2)
