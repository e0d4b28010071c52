"""Chained block hashes: deterministic, chained, salted on block 0, equal across processes."""

from __future__ import annotations

import pytest

from shoal.engine.core.block_hash import BlockHasher, hash_block_tokens, token_bytes
from tests.unit.factories import make_request, run_in_fresh_python


def test_hash_values_are_pinned() -> None:
    """Changing the encoding would silently split caches shared between hosts and versions."""
    hasher = BlockHasher(4)
    assert hasher.none_hash.hex() == (
        "a1585baaf21378bbaa1594edfa11b07d0e2df94823c191dd04809d3de7094d18"
    )
    assert hash_block_tokens(hasher.hash_fn, hasher.none_hash, [1, 2, 3, 4]).hex() == (
        "e9e623ffb895e8caceec0dcff9de342600b357943ec996adf8b669cc82ef2027"
    )


def test_token_encoding_is_little_endian_int64() -> None:
    assert token_bytes([1, 256]) == (1).to_bytes(8, "little") + (256).to_bytes(8, "little")


def test_only_full_blocks_are_hashed_and_the_chain_links_parents() -> None:
    hasher = BlockHasher(4)
    request = make_request("r", list(range(11)))
    hashes = hasher(request)
    assert len(hashes) == 2
    first = hash_block_tokens(hasher.hash_fn, hasher.none_hash, [0, 1, 2, 3])
    second = hash_block_tokens(hasher.hash_fn, first, [4, 5, 6, 7])
    assert hashes == [first, second]


def test_same_block_after_a_different_prefix_hashes_differently() -> None:
    hasher = BlockHasher(2)
    a = hasher(make_request("a", [1, 2, 5, 6]))
    b = hasher(make_request("b", [1, 3, 5, 6]))
    assert a[0] != b[0] and a[1] != b[1]
    assert hasher(make_request("c", [1, 2, 5, 6])) == a


def test_cache_salt_changes_every_hash_of_the_chain() -> None:
    hasher = BlockHasher(2)
    plain = hasher(make_request("a", [1, 2, 3, 4, 5, 6]))
    salted = hasher(make_request("b", [1, 2, 3, 4, 5, 6], cache_salt="tenant-1"))
    other = hasher(make_request("c", [1, 2, 3, 4, 5, 6], cache_salt="tenant-2"))
    assert all(p != s for p, s in zip(plain, salted, strict=True))
    assert all(s != o for s, o in zip(salted, other, strict=True))
    assert hasher(make_request("d", [1, 2, 3, 4, 5, 6], cache_salt="tenant-1")) == salted


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_hashes_are_equal_across_processes(algo: str) -> None:
    if algo == "xxhash":
        pytest.importorskip("xxhash")
    code = (
        "from shoal.engine.core.block_hash import BlockHasher\n"
        "from tests.unit.factories import make_request\n"
        f"h = BlockHasher(4, {algo!r})\n"
        "r = make_request('x', list(range(3, 40)), cache_salt='s')\n"
        "print(','.join(x.hex() for x in h(r)))\n"
    )
    outputs = {run_in_fresh_python(code, seed) for seed in ("1", "2")}
    local = BlockHasher(4, algo)(make_request("x", list(range(3, 40)), cache_salt="s"))
    assert outputs == {",".join(x.hex() for x in local)}
    assert len(local) == 9


def test_unknown_algorithm_is_rejected() -> None:
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        BlockHasher(4, "md5")
