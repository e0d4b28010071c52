"""The filesystem tier's chunk files: a round trip per rank part, every kind of damage found and
its chunk removed, atomic writes, the scan of what a restart finds, and the path scheme (a
directory per model tag and tensor-parallel rank)."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from shoal.bus.messages.offload import KVLayout
from shoal.tiers.books.keys import make_offload_key
from shoal.tiers.secondary import chunk_format, fs_store
from shoal.tiers.secondary.actor import index_from_scan
from shoal.tiers.secondary.chunk_format import HEADER
from shoal.tiers.secondary.fs_store import (
    TMP_SUFFIX,
    ChunkFiles,
    CorruptChunk,
    DeadlinePassed,
    model_dir_name,
)

LAYOUT = KVLayout("tiny/llama:f16", 2, 4, 2, 8, "float16", 2, 2)  # 1 KiB per rank, 2 ranks


def key(i: int) -> bytes:
    return make_offload_key(i.to_bytes(32, "big"))


def slot_bytes(seed: int, layout: KVLayout = LAYOUT) -> bytearray:
    return bytearray((seed * 7 + i) % 251 for i in range(layout.slot_bytes))


def empty_slot(layout: KVLayout = LAYOUT) -> memoryview:
    return memoryview(bytearray(layout.slot_bytes))


@pytest.fixture
def files(tmp_path: Path) -> ChunkFiles:
    return ChunkFiles(tmp_path, LAYOUT)


def stored(files: ChunkFiles, *ids: int) -> None:
    for i in ids:
        files.write_chunk(key(i), memoryview(slot_bytes(i)))


def test_round_trip_puts_each_rank_part_in_its_own_file(files: ChunkFiles, tmp_path: Path) -> None:
    data = slot_bytes(1)
    files.write_chunk(key(1), memoryview(data))
    rank_bytes = LAYOUT.rank_chunk_bytes
    for rank in range(LAYOUT.tp_size):
        path = files.path(key(1), rank)
        hexkey = key(1).hex()
        model_dir = tmp_path / model_dir_name(LAYOUT.model_tag)
        assert path == model_dir / f"tp2_r{rank}" / hexkey[:2] / f"{hexkey}.bin"
        assert path.read_bytes().endswith(bytes(data[rank * rank_bytes : (rank + 1) * rank_bytes]))
    target = empty_slot()
    files.read_chunk(key(1), target)
    assert target.tobytes() == bytes(data)


def damage_flip_a_payload_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x01
    path.write_bytes(raw)


def damage_truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 1)


def damage_truncate_header(path: Path) -> None:
    os.truncate(path, 10)


def damage_bad_magic(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[0:4] = b"XXXX"
    path.write_bytes(raw)


def damage_other_version(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    struct.pack_into("<H", raw, 4, 99)
    path.write_bytes(raw)


def damage_remove(path: Path) -> None:
    path.unlink()


def damage_append(path: Path) -> None:
    with open(path, "ab") as f:
        f.write(b"trailing bytes")


@pytest.mark.parametrize(
    "damage",
    [
        damage_flip_a_payload_byte,
        damage_truncate,
        damage_truncate_header,
        damage_bad_magic,
        damage_other_version,
        damage_remove,
        damage_append,
    ],
)
@pytest.mark.parametrize("rank", [0, 1])
def test_damage_is_found_and_the_whole_chunk_removed(
    files: ChunkFiles, damage: object, rank: int
) -> None:
    stored(files, 1, 2)
    damage(files.path(key(1), rank))  # type: ignore[operator]
    with pytest.raises(CorruptChunk):
        files.read_chunk(key(1), empty_slot())
    assert not any(files.path(key(1), r).exists() for r in range(LAYOUT.tp_size))
    target = empty_slot()
    files.read_chunk(key(2), target)  # a neighbour is untouched
    assert target.tobytes() == bytes(slot_bytes(2))


def test_a_file_holding_another_key_is_corrupt(files: ChunkFiles) -> None:
    stored(files, 1, 2)
    for rank in range(LAYOUT.tp_size):  # every part of chunk 1 now holds chunk 2's bytes
        os.replace(files.path(key(2), rank), files.path(key(1), rank))
    with pytest.raises(CorruptChunk, match="another key"):
        files.read_chunk(key(1), empty_slot())
    assert not files.path(key(1), 0).exists()


def test_a_payload_of_another_length_is_corrupt(tmp_path: Path) -> None:
    small = KVLayout(LAYOUT.model_tag, 1, 4, 2, 8, "float16", 2, 2)  # same dirs, half the bytes
    ChunkFiles(tmp_path, small).write_chunk(key(1), memoryview(slot_bytes(1, small)))
    with pytest.raises(CorruptChunk, match="payload bytes"):
        ChunkFiles(tmp_path, LAYOUT).read_chunk(key(1), empty_slot())


def test_the_header_is_what_the_docstring_says(files: ChunkFiles) -> None:
    stored(files, 3)
    raw = files.path(key(3), 1).read_bytes()
    magic, version, key_len, length, _ = HEADER.unpack_from(raw)
    assert (magic, version, key_len, length) == (b"SHKV", 1, len(key(3)), LAYOUT.rank_chunk_bytes)
    assert raw[HEADER.size : HEADER.size + key_len] == key(3)
    assert len(raw) == HEADER.size + key_len + length


def test_a_failed_write_leaves_no_temp_file_and_no_part(
    files: ChunkFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_replace = os.replace
    calls = []

    def fail_second(src: Path, dst: Path) -> None:
        calls.append((src, dst))
        if len(calls) == 2:
            raise OSError("disk full")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", fail_second)
    with pytest.raises(OSError, match="disk full"):
        stored(files, 1)
    monkeypatch.undo()
    for src, dst in calls:  # each part was written beside its place, then renamed
        assert src.parent == dst.parent and src.name.endswith(TMP_SUFFIX)
    assert [dst for _, dst in calls] == [files.path(key(1), r) for r in range(LAYOUT.tp_size)]
    left = [p for d in files.rank_dirs for p in d.rglob("*") if p.is_file()]
    assert left == []  # rank 0's finished part was removed, rank 1's temp file too


def test_scan_finds_complete_chunks_oldest_first_and_cleans_up(files: ChunkFiles) -> None:
    stored(files, 1, 2, 3, 4)
    mtimes = {1: 300, 2: 100, 3: 200}
    for i, t in mtimes.items():
        for rank in range(LAYOUT.tp_size):
            os.utime(files.path(key(i), rank), ns=(t * 10**9, t * 10**9))
    files.path(key(4), 1).unlink()  # chunk 4 lost a part: incomplete
    temp = files.path(key(5), 0).with_name(f".{key(5).hex()}.abc{TMP_SUFFIX}")
    temp.parent.mkdir(parents=True, exist_ok=True)
    temp.write_bytes(b"half a write")
    (files.rank_dirs[0] / "ab" / "notes.txt").parent.mkdir(parents=True, exist_ok=True)
    (files.rank_dirs[0] / "ab" / "notes.txt").write_text("not ours")

    result = files.scan()
    assert result.keys == [key(2), key(3), key(1)]
    assert (result.num_temp_removed, result.num_partial_removed) == (1, 1)
    assert not temp.exists() and not files.path(key(4), 0).exists()
    assert (files.rank_dirs[0] / "ab" / "notes.txt").exists()


def test_a_read_refreshes_recency_for_the_next_scan(files: ChunkFiles) -> None:
    stored(files, 1, 2)
    for i, t in ((1, 100), (2, 200)):
        for rank in range(LAYOUT.tp_size):
            os.utime(files.path(key(i), rank), ns=(t * 10**9, t * 10**9))
    files.read_chunk(key(1), empty_slot())
    assert files.scan().keys == [key(2), key(1)]


def test_scan_of_an_empty_root_finds_nothing(tmp_path: Path) -> None:
    assert ChunkFiles(tmp_path / "missing", LAYOUT).scan().keys == []


def test_delete_removes_every_part(files: ChunkFiles) -> None:
    stored(files, 1)
    assert files.delete(key(1)) is True
    assert files.delete(key(1)) is False
    assert files.scan().keys == []


def test_layouts_with_another_tag_or_tp_size_live_apart(tmp_path: Path) -> None:
    other_tag = KVLayout("tiny/qwen:f16", 2, 4, 2, 8, "float16", 2, 2)
    other_tp = KVLayout(LAYOUT.model_tag, 2, 4, 4, 8, "float16", 1, 2)  # same slot bytes
    for layout in (LAYOUT, other_tag, other_tp):
        ChunkFiles(tmp_path, layout).write_chunk(key(1), memoryview(slot_bytes(layout.tp_size)))
    dirs = {p.relative_to(tmp_path).parts[:2] for p in tmp_path.rglob("*.bin")}
    assert len(dirs) == 2 + 2 + 1  # (model dir, rank dir) pairs
    for layout in (LAYOUT, other_tag, other_tp):
        target = empty_slot(layout)
        ChunkFiles(tmp_path, layout).read_chunk(key(1), target)
        assert target.tobytes() == bytes(slot_bytes(layout.tp_size))


@pytest.mark.parametrize("tag", ["a/b", "a_b", "../../etc", ".hidden", "", "x" * 300, "ok-1.0_b"])
def test_model_dir_names_are_safe_and_distinct(tag: str) -> None:
    name = model_dir_name(tag)
    assert name and "/" not in name and not name.startswith(".") and len(name) <= 120
    assert (name == tag) == (tag in ("a_b", "ok-1.0_b"))
    assert model_dir_name("a/b") != model_dir_name("a_b")


def test_the_index_of_a_scan_keeps_the_newest_within_budget() -> None:
    index, evicted = index_from_scan(2, [key(1), key(2), key(3)])  # oldest first
    assert evicted == [key(1)]
    assert set(index.chunks) == {key(2), key(3)}
    assert all(c.is_ready for c in index.chunks.values())
    out = index.prepare_store([key(4)])
    assert out is not None and out.evicted_keys == [key(2)]  # the older of the two left


def test_given_stamps_order_the_scan(files: ChunkFiles) -> None:
    for i, stamp_s in ((1, 300), (2, 100), (3, 200)):
        files.write_chunk(key(i), memoryview(slot_bytes(i)), stamp_ns=stamp_s * 10**9)
    assert files.scan().keys == [key(2), key(3), key(1)]
    files.read_chunk(key(1), empty_slot(), stamp_ns=150 * 10**9)  # the stamp given, not now
    assert files.scan().keys == [key(2), key(1), key(3)]


class Clock:
    """Stands in for the ``time`` module of ``fs_store`` and ``chunk_format``: ``time()`` is
    what the test sets."""

    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now

    def time_ns(self) -> int:
        return int(self.now * 10**9)


def all_files(files: ChunkFiles) -> list[Path]:
    return [p for d in files.rank_dirs for p in d.rglob("*") if p.is_file()]


def test_past_its_deadline_a_write_touches_no_slot_and_leaves_no_file(
    files: ChunkFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fs_store, "time", Clock(100.0))
    monkeypatch.setattr(chunk_format, "time", Clock(100.0))
    read: list[object] = []
    real = files._write_temp
    monkeypatch.setattr(files, "_write_temp", lambda *args: read.append(args) or real(*args))
    with pytest.raises(DeadlinePassed):
        files.write_chunk(key(1), memoryview(slot_bytes(1)), deadline=99.0)
    assert all_files(files) == [] and read == []  # the slot was not even read
    files.write_chunk(key(2), memoryview(slot_bytes(2)), deadline=101.0)  # in time
    files.write_chunk(key(3), memoryview(slot_bytes(3)), deadline=0.0)  # none
    assert sorted(files.scan().keys) == sorted([key(2), key(3)])


def test_a_deadline_passing_while_the_slot_is_read_publishes_nothing(
    files: ChunkFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The slot may have been reused while it was read: its temp files are discarded."""
    clock = Clock(100.0)
    monkeypatch.setattr(fs_store, "time", clock)
    monkeypatch.setattr(chunk_format, "time", clock)
    stored(files, 2)  # an older copy of the key: removed too (the fs index holds it no more)
    real = files._write_temp

    def slow_read(*args: object) -> Path:
        path = real(*args)  # type: ignore[arg-type]
        clock.now = 102.0  # the last part read, the deadline has passed
        return path

    monkeypatch.setattr(files, "_write_temp", slow_read)
    files.write_chunk(key(1), memoryview(slot_bytes(1)), deadline=0.0)  # no deadline: published
    assert len(all_files(files)) == 2 * LAYOUT.tp_size
    files.delete(key(1))
    clock.now = 100.0
    with pytest.raises(DeadlinePassed):
        files.write_chunk(key(2), memoryview(slot_bytes(2)), deadline=101.0)
    assert all_files(files) == []  # no temp file, no part of either copy


def test_past_its_deadline_a_read_leaves_the_slot_and_the_files_alone(
    files: ChunkFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    stored(files, 1)
    monkeypatch.setattr(fs_store, "time", Clock(100.0))
    monkeypatch.setattr(chunk_format, "time", Clock(100.0))
    target = empty_slot()
    with pytest.raises(DeadlinePassed):
        files.read_chunk(key(1), target, deadline=99.0)
    assert target.tobytes() == bytes(LAYOUT.slot_bytes)
    assert len(all_files(files)) == LAYOUT.tp_size  # not corrupt: kept
    files.read_chunk(key(1), target, deadline=101.0)
    assert target.tobytes() == bytes(slot_bytes(1))
