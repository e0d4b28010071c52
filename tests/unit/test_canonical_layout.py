"""The canonical layout outside the workers: an engine core's layout with ``canonical_layout`` is
the same at TP=1 and TP=2 (one part, every KV head; the tensor-parallel size is nowhere in it,
its model tag included), and different from either per-rank layout; the filesystem and object
tiers keep a canonical chunk as one part under ``canonical/``, apart from per-rank parts of the
same model tag, which a canonical scan neither counts nor removes."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from shoal.bus.messages.offload import KVLayout
from shoal.bus.messages.worker import WorkerInfo
from shoal.config.deployment import ShoalConfig
from shoal.engine.actor.offload_link import kv_layout
from shoal.tiers.books.keys import make_offload_key
from shoal.tiers.secondary.fs_store import ChunkFiles, model_dir_name
from shoal.tiers.secondary.obj_store import ObjectChunks

LAYERS, BLOCK, HEAD_DIM, HEADS = 2, 16, 16, 2
CANONICAL = KVLayout("tiny/llama", LAYERS, 4, HEADS, 8, "float16", 1, 2, canonical=True)
PER_RANK = KVLayout("tiny/llama", LAYERS, 4, 1, 8, "float16", 2, 2)  # same tag, TP=2


def config(canonical: bool) -> ShoalConfig:
    extra = {"cpu_bytes_to_use": 1 << 20, "canonical_layout": canonical}
    return ShoalConfig.from_options(
        model="/models/tiny",
        kv_transfer_config={
            "kv_connector": "OffloadingConnector",
            "kv_connector_extra_config": extra,
        },
    )


def infos(tp_size: int, total_kv_heads: int = HEADS) -> list[WorkerInfo]:
    """What the workers of a TP=``tp_size`` engine core report (the model has 2 KV heads)."""
    return [
        WorkerInfo(
            f"w{rank}",
            64,
            BLOCK,
            1024,
            320,
            [2],
            "i",
            tp_rank=rank,
            tp_size=tp_size,
            num_layers=LAYERS,
            num_kv_heads=max(1, HEADS // tp_size),
            head_dim=HEAD_DIM,
            kv_dtype="float32",
            total_kv_heads=total_kv_heads,
        )
        for rank in range(tp_size)
    ]


def test_a_canonical_layout_is_the_same_at_every_tp_size() -> None:
    one, two = kv_layout(config(True), infos(1)), kv_layout(config(True), infos(2))
    assert one == two
    assert (one.canonical, one.tp_size, one.num_kv_heads) == (True, 1, HEADS)
    assert one.slot_bytes == LAYERS * 2 * BLOCK * HEADS * HEAD_DIM * 4  # every head, once
    per_rank = {kv_layout(config(False), infos(tp)) for tp in (1, 2)}
    assert len(per_rank) == 2 and one not in per_rank
    assert one.model_tag not in {layout.model_tag for layout in per_rank}
    with pytest.raises(ValueError, match="model's KV heads"):
        kv_layout(config(True), infos(2, total_kv_heads=0))


def key(i: int) -> bytes:
    return make_offload_key(i.to_bytes(32, "big"))


def slot(layout: KVLayout, seed: int) -> memoryview:
    return memoryview(bytearray((seed * 7 + i) % 251 for i in range(layout.slot_bytes)))


def test_the_fs_tier_keeps_a_canonical_chunk_as_one_part(tmp_path: Path) -> None:
    canonical, per_rank = ChunkFiles(tmp_path, CANONICAL), ChunkFiles(tmp_path, PER_RANK)
    data = slot(CANONICAL, 1)
    canonical.write_chunk(key(1), data)
    for i in (1, 2):  # key 1 in both layouts
        per_rank.write_chunk(key(i), slot(PER_RANK, 2), stamp_ns=i)
    name = key(1).hex()
    path = tmp_path / model_dir_name(CANONICAL.model_tag) / "canonical" / name[:2] / f"{name}.bin"
    assert canonical.path(key(1), 0) == path and path.read_bytes().endswith(bytes(data))
    assert len(list(tmp_path.rglob("*.bin"))) == 5  # one canonical part, four rank parts
    assert canonical.scan().keys == [key(1)]
    assert per_rank.scan().keys == [key(1), key(2)]  # neither took the other's as partial
    assert len(list(tmp_path.rglob("*.bin"))) == 5
    back = memoryview(bytearray(CANONICAL.slot_bytes))
    canonical.read_chunk(key(1), back)
    assert bytes(back) == bytes(data)


@dataclass
class Entry:
    name: str
    mtime: str


class FakeObjectStore:
    """``bus.jetstream.object_store.ObjectStore``'s calls, in memory."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    async def put(self, name: str, data: bytes, *, writer: str = "") -> None:
        self.objects[name] = bytes(data)

    async def get(self, name: str, timeout: float = 0.0) -> bytes | None:
        return self.objects.get(name)

    async def delete(self, name: str) -> bool:
        return self.objects.pop(name, None) is not None

    async def list(self) -> list[Entry]:
        return [Entry(name, f"{i:04}") for i, name in enumerate(self.objects)]


def test_the_object_tier_keeps_a_canonical_chunk_as_one_object() -> None:
    async def run() -> None:
        store: Any = FakeObjectStore()
        canonical, per_rank = ObjectChunks(store, CANONICAL), ObjectChunks(store, PER_RANK)
        data = slot(CANONICAL, 3)
        await canonical.write_chunk(key(1), data)
        for i in (1, 2):  # key 1 in both layouts
            await per_rank.write_chunk(key(i), slot(PER_RANK, 4))
        model_dir = model_dir_name(CANONICAL.model_tag)
        assert set(store.objects) == {
            f"{model_dir}/canonical/{key(1).hex()}",
            *(f"{model_dir}/tp2_r{rank}/{key(i).hex()}" for rank in (0, 1) for i in (1, 2)),
        }
        assert [found.key for found in await canonical.scan()] == [key(1)]
        assert [found.key for found in await per_rank.scan()] == [key(1), key(2)]
        assert len(store.objects) == 5  # neither scan took the other's objects for its own
        back = memoryview(bytearray(CANONICAL.slot_bytes))
        await canonical.read_chunk(key(1), back)
        assert bytes(back) == bytes(data)

    asyncio.run(run())
