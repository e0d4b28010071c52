"""The routing benchmark's traces and its ideal hit rate (``bench/routing_trace.py``): the
ideal counts as the engine does (full blocks, never the prompt's last token) and only what an
earlier wave computed."""

from __future__ import annotations

from bench.routing_trace import (
    IdealCache,
    TraceShape,
    num_waves,
    shared_trace,
    unique_trace,
    wave_requests,
)

SHAPE = TraceShape(groups=2, convs=3, turns=2, system_len=40, user_len=8, max_tokens=4)
VOCAB = 500


def test_first_conversation_of_each_group_starts_a_wave_early() -> None:
    conversations = shared_trace(SHAPE, seed=0, vocab=VOCAB)
    assert num_waves(conversations) == SHAPE.turns + 1
    assert wave_requests(conversations, 0) == [(0, 0), (3, 0)]
    assert sorted(wave_requests(conversations, 1)) == [
        (i, 1 if i in (0, 3) else 0) for i in range(6)
    ]
    assert all(c.system == conversations[0].system for c in conversations[:3])
    assert conversations[0].system != conversations[3].system


def test_a_turn_extends_the_conversation_so_far() -> None:
    conv = shared_trace(SHAPE, seed=0, vocab=VOCAB)[0]
    first = conv.prompt(0)
    assert first == conv.system + conv.users[0]
    conv.answered(first, [7, 8, 9, 10])
    assert conv.prompt(1) == first + [7, 8, 9, 10] + conv.users[1]


def test_ideal_hits_only_what_an_earlier_wave_computed() -> None:
    ideal = IdealCache(block_size=4)
    prompt = list(range(3, 3 + 18))  # 4 full blocks and 2 tokens
    assert ideal.hit_tokens(prompt) == 0
    ideal.computed(prompt, [100, 101, 102])
    assert ideal.hit_tokens(prompt) == 0  # the same wave: not computed yet
    ideal.next_wave()
    assert ideal.hit_tokens(prompt) == 16
    # prompt + output[:-1] is 20 tokens = 5 blocks; a longer prompt hits all five
    assert ideal.hit_tokens([*prompt, 100, 555, 556, 557]) == 16
    assert ideal.hit_tokens([*prompt, 100, 101, 102, 556, 557]) == 20
    assert ideal.hit_tokens(prompt[:16]) == 12  # never the last token's block
    assert ideal.hit_tokens([9, *prompt[1:]]) == 0  # a chain: the first block differs


def test_unique_trace_shares_nothing() -> None:
    conversations = unique_trace(SHAPE, seed=1, vocab=VOCAB)
    assert len(conversations) == SHAPE.groups * SHAPE.convs * SHAPE.turns
    ideal = IdealCache(block_size=4)
    hits = 0
    for wave in range(num_waves(conversations)):
        for i, turn in wave_requests(conversations, wave):
            prompt = conversations[i].prompt(turn)
            assert len(prompt) == SHAPE.system_len + SHAPE.user_len
            hits += ideal.hit_tokens(prompt)
            ideal.computed(prompt, [5, 6])
        ideal.next_wave()
    assert hits == 0
