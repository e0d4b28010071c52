"""The block pool's arrays: the C implementation (where setup.py built it) does what the Python
one does, operation for operation, under random sequences of takes, caches, touches, frees and
lookups (hypothesis); and the Python one keeps the free queue's order and the map's rules."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.engine.core.block_pool_arrays import (
    BlockArrays,
    BlockArraysLike,
    make_block_arrays,
    native_block_arrays_available,
)

needs_native = pytest.mark.skipif(
    not native_block_arrays_available(), reason="the C arrays are not built here (no compiler)"
)

NUM_BLOCKS = 20
# Few distinct keys of assorted lengths (1-32 bytes), so hashes repeat across blocks and the
# map's probe runs collide and shift.
KEYS = [bytes([i]) * (1 + i % 32) for i in range(24)] + [b"\x00" * 32, b"\xff" * 16]

OPS = st.lists(
    st.tuples(
        st.sampled_from(["take", "cache", "touch", "free", "free_drop", "lookup", "clear"]),
        st.integers(0, 40),
        st.lists(st.integers(0, len(KEYS) - 1), max_size=6),
    ),
    max_size=60,
)


def state(arrays: BlockArraysLike, num_blocks: int) -> tuple[object, ...]:
    """Everything the arrays hold, as their interface shows it."""
    ids = range(num_blocks)
    return (
        arrays.num_free,
        arrays.num_cached,
        arrays.free_ids(),
        sorted(arrays.cached_keys()),
        [arrays.ref_cnt(i) for i in ids],
        [arrays.block_hash(i) for i in ids],
    )


def apply(arrays: BlockArraysLike, held: list[int], op: str, n: int, keys: list[int]) -> object:
    """One operation on both sides alike; returns what it answered."""
    if op == "take":
        count = min(n % 9, arrays.num_free)
        removed: list[bytes] = []
        ids = arrays.take(count, removed)
        held.extend(ids)
        return ids, removed
    if op == "cache" and held:
        ids = [held[(n + i) % len(held)] for i in range(len(keys))]
        added: list[bool] = []
        arrays.cache(ids, [KEYS[k] for k in keys], added)
        return added
    if op == "touch":
        ids = [i for i in (arrays.lookup(KEYS[k]) for k in keys) if i >= 0]
        arrays.touch(ids)
        held.extend(ids)
        return ids
    if op in ("free", "free_drop") and held:
        count = 1 + n % len(held)
        ids, held[:] = held[-count:], held[:-count]
        removed = []
        arrays.free(list(reversed(ids)), op == "free_drop", removed)
        return removed
    if op == "lookup":
        wanted = [KEYS[k] for k in keys]
        return arrays.lookup_prefix(wanted), [arrays.lookup(key) for key in wanted]
    if op == "clear" and arrays.num_free == NUM_BLOCKS - 1:  # as reset_prefix_cache allows
        arrays.clear_hashes()
    return None


@needs_native
@settings(max_examples=300, deadline=None)
@given(OPS)
def test_the_c_arrays_answer_as_the_python_ones(ops) -> None:  # type: ignore[no-untyped-def]
    python, native = BlockArrays(NUM_BLOCKS), make_block_arrays(NUM_BLOCKS, native=True)
    held_python: list[int] = []
    held_native: list[int] = []
    for op, n, keys in ops:
        assert apply(python, held_python, op, n, keys) == apply(native, held_native, op, n, keys)
        assert held_python == held_native
        assert state(python, NUM_BLOCKS) == state(native, NUM_BLOCKS)


@needs_native
@settings(max_examples=40, deadline=None)
@given(st.randoms(use_true_random=False))
def test_a_full_map_emptied_in_any_order_keeps_finding_what_is_left(rng) -> None:  # type: ignore[no-untyped-def]
    """Every block cached under its own key (the table as full as it gets: probe runs collide),
    then evicted in a random order: after each eviction every key left is still found, at its
    block (backward-shift deletion moves entries up without losing them)."""
    num_blocks = 200
    python, native = BlockArrays(num_blocks), make_block_arrays(num_blocks, native=True)
    keys = [  # distinct, of assorted lengths
        i.to_bytes(2, "little") + rng.randbytes(rng.choice([6, 14, 30]))
        for i in range(1, num_blocks)
    ]
    for arrays in (python, native):
        ids = arrays.take(num_blocks - 1, None)
        arrays.cache(ids, keys, None)
        arrays.free(ids, False, None)  # all free, all cached: taking evicts them front first
    left = dict(zip(keys, range(1, num_blocks), strict=True))
    order = list(range(1, num_blocks))
    rng.shuffle(order)
    for block_id in order:
        for arrays in (python, native):
            arrays.touch([block_id])
            removed: list[bytes] = []
            arrays.free([block_id], True, removed)
            assert removed == [keys[block_id - 1]]
        del left[keys[block_id - 1]]
        assert [native.lookup(k) for k in left] == list(left.values())
        assert [python.lookup(k) for k in left] == list(left.values())
        assert native.num_cached == python.num_cached == len(left)


@pytest.mark.parametrize(
    "native",
    [False, pytest.param(True, marks=needs_native)],
    ids=["python", "native"],
)
def test_a_key_held_twice_is_taken_again_once_its_mapped_block_is_evicted(native: bool) -> None:
    """Two blocks hold one key, the map names the first; the first is taken for new data (its
    key evicted): caching the second under the key again puts it in the map (reported added)."""
    arrays = make_block_arrays(4, native=native)
    first, second = arrays.take(2, None)
    added: list[bool] = []
    arrays.cache([first, second], [b"k", b"k"], added)
    assert added == [True, False] and arrays.lookup(b"k") == first
    arrays.free([second, first], False, None)  # both hashed: to the back, second first
    arrays.touch([second])  # the second in use again; the first is evicted when taken
    removed: list[bytes] = []
    assert arrays.take(2, removed) == [first, 3] and removed == [b"k"]
    assert arrays.lookup(b"k") == -1 and arrays.block_hash(second) == b"k"
    added = []
    arrays.cache([second], [b"k"], added)
    assert added == [True] and arrays.lookup(b"k") == second
    added = []
    arrays.cache([second], [b"k"], added)  # already named for it: not taken again
    assert added == [False] and arrays.num_cached == 1
