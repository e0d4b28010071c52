"""Block hashes with a LoRA adapter: the adapter's name is an extra key of every block."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from shoal.bus.messages.lora import LoRARequest
from shoal.engine.core.block_hash import (
    BlockHash,
    BlockHasher,
    extra_keys,
    hash_block_tokens,
    salt_extra_key,
)
from shoal.engine.core.request import Request
from tests.unit.factories import make_request

PROMPT = list(range(100, 118))  # four full blocks of 4, and two tokens more
SQL = LoRARequest("sql", 1, "/adapters/sql")
CHAT = LoRARequest("chat", 2, "/adapters/chat")

SQL_KEY = b"lora:" + (3).to_bytes(4, "little") + b"sql"  # adapter "sql", length first


def lora_request(
    request_id: str,
    prompt: Sequence[int] = PROMPT,
    lora: LoRARequest | None = None,
    cache_salt: str | None = None,
) -> Request:
    request = make_request(request_id, prompt, cache_salt=cache_salt)
    request.lora_request = lora
    return request


def salt_only_hashes(
    hasher: BlockHasher, token_ids: Sequence[int], cache_salt: str | None = None
) -> list[BlockHash]:
    """The hashes as they were before adapters: the salt on block 0, nothing on later blocks."""
    size = hasher.block_size
    parent, hashes = hasher.none_hash, []
    for index in range(len(token_ids) // size):
        extra = salt_extra_key(cache_salt) if index == 0 else b""
        parent = hash_block_tokens(
            hasher.hash_fn, parent, token_ids[index * size : (index + 1) * size], extra
        )
        hashes.append(parent)
    return hashes


def test_extra_keys() -> None:
    assert extra_keys(0, None, None) == b""
    assert extra_keys(3, None, None) == b""
    assert extra_keys(0, "t", None) == b"salt:t"
    assert extra_keys(1, "t", None) == b""
    assert extra_keys(0, None, "sql") == SQL_KEY
    assert extra_keys(5, None, "sql") == SQL_KEY
    assert extra_keys(0, "t", "sql") == SQL_KEY + b"salt:t"
    assert extra_keys(2, "t", "sql") == SQL_KEY


def test_two_adapters_share_no_block() -> None:
    hasher = BlockHasher(4)
    sql = hasher(lora_request("a", lora=SQL))
    chat = hasher(lora_request("b", lora=CHAT))
    plain = hasher(lora_request("c"))
    assert len(sql) == len(chat) == len(plain) == 4
    assert set(sql).isdisjoint(chat)
    assert set(sql).isdisjoint(plain) and set(chat).isdisjoint(plain)


def test_the_adapter_keys_every_block_not_only_through_the_chain() -> None:
    """Block ``i``'s key names the adapter itself: with the parent of the plain chain, a
    block hashed with the adapter still differs (vLLM's extra key per block)."""
    hasher = BlockHasher(4)
    sql = hasher(lora_request("a", lora=SQL))
    parent = hasher.none_hash
    for index, block_hash in enumerate(sql):
        block = PROMPT[index * 4 : (index + 1) * 4]
        assert block_hash == hash_block_tokens(hasher.hash_fn, parent, block, SQL_KEY)
        assert block_hash != hash_block_tokens(hasher.hash_fn, parent, block)
        parent = block_hash


def test_the_same_adapter_gives_the_same_hashes() -> None:
    hasher = BlockHasher(4)
    first = hasher(lora_request("a", lora=SQL))
    # Another request (another id, another LoRARequest object with the same name) agrees.
    again = hasher(lora_request("b", lora=LoRARequest("sql", 1, "/adapters/sql")))
    assert first == again
    assert BlockHasher(4)(lora_request("c", lora=SQL)) == first


def test_the_adapter_name_is_the_key_not_its_id_or_path() -> None:
    hasher = BlockHasher(4)
    first = hasher(lora_request("a", lora=SQL))
    moved = hasher(lora_request("b", lora=LoRARequest("sql", 7, "nats-object://sql")))
    assert moved == first


@pytest.mark.parametrize("cache_salt", [None, "tenant-1"])
def test_without_an_adapter_the_hashes_are_unchanged(cache_salt: str | None) -> None:
    hasher = BlockHasher(4)
    plain = hasher(lora_request("a", cache_salt=cache_salt))
    assert plain == salt_only_hashes(hasher, PROMPT, cache_salt)
    assert hasher.prompt_block_hashes(PROMPT, cache_salt) == plain
    assert hasher.prompt_block_hashes(PROMPT, cache_salt, lora_name=None) == plain


def test_hashes_without_an_adapter_are_pinned() -> None:
    """Adding adapters must not move the keys of the caches that exist without them."""
    hasher = BlockHasher(4)
    hashes = hasher(lora_request("a", [1, 2, 3, 4, 5, 6, 7, 8]))
    assert hashes[0].hex() == ("e9e623ffb895e8caceec0dcff9de342600b357943ec996adf8b669cc82ef2027")
    assert hashes == salt_only_hashes(hasher, [1, 2, 3, 4, 5, 6, 7, 8])


@pytest.mark.parametrize("cache_salt", [None, "tenant-1"])
@pytest.mark.parametrize("lora", [SQL, CHAT])
def test_prompt_block_hashes_agree_with_the_hasher(
    lora: LoRARequest, cache_salt: str | None
) -> None:
    hasher = BlockHasher(4)
    expected = hasher(lora_request("a", lora=lora, cache_salt=cache_salt))
    assert hasher.prompt_block_hashes(PROMPT, cache_salt, lora_name=lora.lora_name) == expected
    assert (
        hasher.prompt_block_hashes(PROMPT, cache_salt, max_blocks=2, lora_name=lora.lora_name)
        == expected[:2]
    )
    assert hasher.prompt_block_hashes(PROMPT, cache_salt) != expected


def test_a_salt_and_an_adapter_differ_from_either_alone() -> None:
    hasher = BlockHasher(4)
    both = hasher(lora_request("a", lora=SQL, cache_salt="tenant-1"))
    salt_only = hasher(lora_request("b", cache_salt="tenant-1"))
    lora_only = hasher(lora_request("c", lora=SQL))
    plain = hasher(lora_request("d"))
    for other in (salt_only, lora_only, plain):
        assert set(both).isdisjoint(other)
    assert hasher(lora_request("e", lora=SQL, cache_salt="tenant-2")) != both


def test_blocks_filled_by_outputs_carry_the_adapter_too() -> None:
    """The hasher extends the chain as outputs fill blocks; those blocks are keyed too."""
    hasher = BlockHasher(4)
    with_lora = lora_request("a", PROMPT[:6], lora=SQL)
    with_lora.set_block_hasher(hasher)
    plain = lora_request("b", PROMPT[:6])
    plain.set_block_hasher(hasher)
    for token in (7, 8, 9, 10, 11, 12):
        with_lora.append_output_token_id(token)
        plain.append_output_token_id(token)
    assert len(with_lora.block_hashes) == len(plain.block_hashes) == 3
    assert with_lora.block_hashes == hasher.prompt_block_hashes(
        with_lora.all_token_ids, lora_name="sql"
    )
    assert set(with_lora.block_hashes).isdisjoint(plain.block_hashes)
    parent = with_lora.block_hashes[1]
    last = with_lora.all_token_ids[8:12]
    assert with_lora.block_hashes[2] == hash_block_tokens(hasher.hash_fn, parent, last, SQL_KEY)


def test_adapter_names_that_prefix_each_other_do_not_collide() -> None:
    hasher = BlockHasher(4)
    names = ["a", "ab", "a b", "b"]
    chains = [hasher.prompt_block_hashes(PROMPT, lora_name=name) for name in names]
    blocks = [block for chain in chains for block in chain]
    assert len(set(blocks)) == len(blocks)


def test_a_salt_cannot_pose_as_a_salt_and_an_adapter() -> None:
    hasher = BlockHasher(4)
    with_adapter = hasher.prompt_block_hashes(PROMPT, "t", lora_name="sql")
    posing = hasher.prompt_block_hashes(PROMPT, "tlora:sql")
    assert with_adapter[0] != posing[0]
