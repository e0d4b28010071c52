"""The free queue threaded through the blocks: order, membership and length under any mix of
operations, checked against a plain list."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shoal.engine.core.free_block_queue import FreeBlockQueue, KVCacheBlock


def make_blocks(count: int) -> list[KVCacheBlock]:
    return [KVCacheBlock(block_id) for block_id in range(1, count + 1)]


def test_blocks_come_out_front_first_and_go_back_at_either_end() -> None:
    blocks = make_blocks(6)
    queue = FreeBlockQueue(blocks)
    assert len(queue) == 6 and queue.block_ids() == [1, 2, 3, 4, 5, 6]
    taken = queue.popleft_n(3)
    assert [block.block_id for block in taken] == [1, 2, 3]
    assert queue.block_ids() == [4, 5, 6] and len(queue) == 3
    assert all(block not in queue for block in taken)
    queue.extend([taken[1], taken[0]])  # to the back, in order
    queue.extendleft([taken[2]])  # to the front
    assert queue.block_ids() == [3, 4, 5, 6, 2, 1]
    queue.remove(blocks[4])  # from the middle
    queue.remove(blocks[2])  # the front
    queue.remove(blocks[0])  # the back
    assert queue.block_ids() == [4, 6, 2] and len(queue) == 3
    assert blocks[4] not in queue and blocks[3] in queue


def test_extendleft_puts_the_last_block_first() -> None:
    queue = FreeBlockQueue([])
    blocks = make_blocks(3)
    queue.extendleft(blocks)
    assert queue.block_ids() == [3, 2, 1]
    assert [block.block_id for block in queue.popleft_n(3)] == [3, 2, 1]
    assert len(queue) == 0 and queue.block_ids() == []


OPERATION = st.one_of(
    st.tuples(st.just("pop"), st.integers(0, 6)),
    st.tuples(st.just("back"), st.integers(0, 6)),
    st.tuples(st.just("front"), st.integers(0, 6)),
    st.tuples(st.just("remove"), st.integers(0, 40)),
)


@given(st.lists(OPERATION, max_size=60))
def test_any_mix_of_operations_keeps_the_order_a_list_would(
    operations: list[tuple[str, int]],
) -> None:
    blocks = make_blocks(30)
    queue = FreeBlockQueue(blocks[:20])
    model = list(blocks[:20])  # front first
    held = list(blocks[20:])
    for name, number in operations:
        if name == "pop":
            count = min(number, len(model))
            taken = queue.popleft_n(count)
            assert taken == model[:count]
            del model[:count]
            held.extend(taken)
        elif name in ("back", "front"):
            moving, held = held[:number], held[number:]
            if name == "back":
                queue.extend(moving)
                model.extend(moving)
            else:
                queue.extendleft(moving)
                model[:0] = reversed(moving)
        elif model:
            block = model.pop(number % len(model))
            queue.remove(block)
            held.append(block)
        assert len(queue) == len(model)
        assert list(queue) == model
        assert all(block not in queue for block in held)
        assert all(block in queue for block in model)
