"""Dual-batch overlap's pure parts: vLLM's threshold rules, the empty-last-micro-batch veto, the
agreement across data-parallel ranks, and the token split with each micro-batch's attention
metadata (a request spanning both halves, padding, uneven splits), checked against running the
halves one after the other over the same paged KV cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shoal.bus.messages.sampling import SamplingParams
from shoal.kernels import ops
from shoal.workers.dbo.thresholds import (
    BatchDecision,
    RankBatch,
    check_ubatch_thresholds,
    coordinate_batch_across_dp,
    is_last_ubatch_empty,
)
from shoal.workers.dbo.ubatch_slices import UBatchSlice, make_ubatch_slices, slice_metadata
from shoal.workers.input_batch import InputBatch, StepInputs
from shoal.workers.request_store import RequestStore

# ---- thresholds and the veto ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_tokens", "uniform_decode", "expected"),
    [(31, True, False), (32, True, True), (33, True, True), (0, True, False),
     (511, False, False), (512, False, True), (513, False, True), (32, False, False),
     (100, True, True), (100, False, False)],
)  # fmt: skip
def test_default_thresholds(num_tokens: int, uniform_decode: bool, expected: bool) -> None:
    assert check_ubatch_thresholds(num_tokens, uniform_decode) is expected


def test_custom_thresholds_apply_to_their_kind_only() -> None:
    assert check_ubatch_thresholds(8, True, decode_threshold=8, prefill_threshold=64)
    assert not check_ubatch_thresholds(7, True, decode_threshold=8, prefill_threshold=4)
    assert check_ubatch_thresholds(64, False, decode_threshold=1000, prefill_threshold=64)
    assert not check_ubatch_thresholds(63, False, decode_threshold=2, prefill_threshold=64)


@pytest.mark.parametrize(
    ("orig", "padded", "n", "expected"),
    [(10, 10, 2, False), (5, 10, 2, True), (6, 10, 2, False), (5, 11, 2, True),
     (1, 1, 2, False), (1, 2, 2, True), (20, 30, 3, True), (21, 30, 3, False)],
)  # fmt: skip
def test_last_ubatch_empty(orig: int, padded: int, n: int, expected: bool) -> None:
    assert is_last_ubatch_empty(orig, padded, n) is expected


# ---- agreement across data-parallel ranks --------------------------------------------------


def decisions(*reports: RankBatch, **kw: int | bool) -> list[tuple[bool, int]]:
    got = coordinate_batch_across_dp(reports, **kw)
    return [(d.should_ubatch, d.num_tokens_padded) for d in got]


def dec(num_tokens: int) -> RankBatch:
    """A uniform decode batch that allows micro-batching."""
    return RankBatch(num_tokens, uniform_decode=True, allow_microbatching=True)


def pre(num_tokens: int) -> RankBatch:
    """A batch with prefill chunks that allows micro-batching."""
    return RankBatch(num_tokens, uniform_decode=False, allow_microbatching=True)


def test_all_ranks_vote_yes_pads_everyone_to_the_max() -> None:
    assert decisions(pre(600), dec(320), pre(520)) == [(True, 600)] * 3


def test_one_rank_voting_no_means_nobody_splits_nor_pads() -> None:
    assert decisions(pre(600), dec(31)) == [(False, 600), (False, 31)]  # under its threshold
    vetoed = RankBatch(900, False, False)  # large but not allowed (prefix reader before writer)
    assert decisions(pre(600), vetoed) == [(False, 600), (False, 900)]
    assert decisions(pre(0), pre(4096)) == [(False, 0), (False, 4096)]  # a rank's dummy step


def test_each_rank_checks_its_own_kind_of_threshold() -> None:
    assert decisions(dec(40), dec(40)) == [(True, 40)] * 2  # a decode batch of 40 splits
    assert decisions(pre(40), dec(40)) == [(False, 40)] * 2  # a prefill batch of 40 does not


def test_empty_last_ubatch_vetoes_the_split_for_min_orig_and_max_padded() -> None:
    # every rank votes yes, but the smallest rank's tokens all fall before 64 // 2
    assert decisions(dec(32), dec(64)) == [(False, 32), (False, 64)]
    assert decisions(dec(33), dec(64)) == [(True, 64)] * 2  # one real token after the split
    assert decisions(dec(40), pre(600)) == [(False, 40), (False, 600)]  # 40 <= 600 // 2
    three = dict(num_ubatches=3, decode_threshold=3)
    assert decisions(dec(20), dec(30), **three) == [(False, 20), (False, 30)]  # 20 <= 2 * 10
    assert decisions(dec(21), dec(30), **three) == [(True, 30)] * 2


def test_without_padding_across_ranks_each_keeps_its_own_count() -> None:
    """shoal's workers split their own tokens: unequal ranks split when every one votes yes."""
    own = dict(pad_across_ranks=False)
    assert decisions(dec(32), dec(64), **own) == [(True, 32), (True, 64)]
    assert decisions(dec(40), pre(600), **own) == [(True, 40), (True, 600)]
    assert decisions(dec(31), dec(64), **own) == [(False, 31), (False, 64)]  # a vote no
    tiny = dict(pad_across_ranks=False, decode_threshold=2)
    assert decisions(dec(2), dec(9), **tiny) == [(True, 2), (True, 9)]  # one token each side


def test_a_single_rank_never_splits() -> None:
    assert coordinate_batch_across_dp([pre(4096)]) == [BatchDecision(False, 4096)]


def test_bad_configs_and_reports_are_refused() -> None:
    two = [RankBatch(600, False, True)] * 2
    with pytest.raises(ValueError, match="below the micro-batch count"):
        coordinate_batch_across_dp(two, num_ubatches=4, decode_threshold=3)
    with pytest.raises(ValueError, match="below the micro-batch count"):
        coordinate_batch_across_dp(two, prefill_threshold=1)
    with pytest.raises(ValueError, match="at least 2"):
        coordinate_batch_across_dp(two, num_ubatches=1)
    with pytest.raises(ValueError, match="no rank"):
        coordinate_batch_across_dp([])
    with pytest.raises(ValueError, match="negative"):
        coordinate_batch_across_dp([RankBatch(-1, False, True)] * 2)


# ---- slices ------------------------------------------------------------------------------


def whole_step(computed: list[int], scheduled: list[int]) -> StepInputs:
    """The step's inputs as the worker builds them (prompts long enough for every schedule)."""
    max_len = max(c + s for c, s in zip(computed, scheduled, strict=True)) + 1
    batch = InputBatch(RequestStore(max_num_reqs=len(computed), vocab_size=64),
                       max_model_len=max_len, block_size=4)  # fmt: skip
    num_blocks = -(-max_len // 4)
    for i, c in enumerate(computed):
        blocks = list(range(i * num_blocks, (i + 1) * num_blocks))
        batch.add_request(f"r{i}", [i + 1] * max_len, blocks, c, SamplingParams(max_tokens=1))
    return batch.prepare_inputs([f"r{i}" for i in range(len(computed))], scheduled)


def spans(slices: list[UBatchSlice]) -> list[tuple[int, int, int, int]]:
    return [(s.request_slice.start, s.request_slice.stop, s.token_slice.start,
             s.token_slice.stop) for s in slices]  # fmt: skip


def check_halves_replay_the_step(inputs: StepInputs, slices: list[UBatchSlice]) -> None:
    """Each micro-batch's positions agree with its sliced lengths: a request's tokens in the
    slice are exactly positions seq_len - query_len .. seq_len - 1."""
    for s in slices:
        meta = slice_metadata(inputs.query_start_loc, inputs.seq_lens, s)
        positions = inputs.positions[s.token_slice]
        for j in range(s.num_reqs):
            lo, hi = meta.query_start_loc[j], meta.query_start_loc[j + 1]
            seq_len = int(meta.seq_lens[j])
            assert positions[lo:hi].tolist() == list(range(seq_len - (hi - lo), seq_len))


def test_all_decodes_split_by_requests() -> None:
    inputs = whole_step([5, 9, 2, 7], [1, 1, 1, 1])
    slices = make_ubatch_slices(inputs.num_scheduled, 4)
    assert spans(slices) == [(0, 2, 0, 2), (2, 4, 2, 4)]
    first, second = (slice_metadata(inputs.query_start_loc, inputs.seq_lens, s) for s in slices)
    assert first.query_start_loc.tolist() == [0, 1, 2] and first.seq_lens.tolist() == [6, 10]
    assert second.query_start_loc.tolist() == [0, 1, 2] and second.seq_lens.tolist() == [3, 8]
    assert (first.max_query_len, first.max_seq_len) == (1, 10)
    assert (second.max_query_len, second.max_seq_len) == (1, 8)
    check_halves_replay_the_step(inputs, slices)


def test_one_long_prefill_spans_both_halves() -> None:
    inputs = whole_step([3], [10])  # positions 3..12, seq_len 13
    slices = make_ubatch_slices(inputs.num_scheduled, 10)
    assert spans(slices) == [(0, 1, 0, 5), (0, 1, 5, 10)]
    first, second = (slice_metadata(inputs.query_start_loc, inputs.seq_lens, s) for s in slices)
    assert first.query_start_loc.tolist() == [0, 5] and first.seq_lens.tolist() == [8]
    assert second.query_start_loc.tolist() == [0, 5] and second.seq_lens.tolist() == [13]
    assert (first.max_query_len, first.max_seq_len, second.max_seq_len) == (5, 8, 13)
    check_halves_replay_the_step(inputs, slices)


def test_mixed_prefill_chunks_and_decodes() -> None:
    # decode, chunk of 6 cut at token 5 (4 before, 2 after), decode, chunk of 3
    inputs = whole_step([8, 0, 4, 10], [1, 6, 1, 3])
    slices = make_ubatch_slices(inputs.num_scheduled, 11)
    assert spans(slices) == [(0, 2, 0, 5), (1, 4, 5, 11)]
    first, second = (slice_metadata(inputs.query_start_loc, inputs.seq_lens, s) for s in slices)
    assert first.query_start_loc.tolist() == [0, 1, 5] and first.seq_lens.tolist() == [9, 4]
    assert second.query_start_loc.tolist() == [0, 2, 3, 6]
    assert second.seq_lens.tolist() == [6, 5, 13] and second.max_query_len == 3
    check_halves_replay_the_step(inputs, slices)


def test_a_split_on_a_request_boundary_cuts_nobody() -> None:
    inputs = whole_step([0, 0], [4, 4])
    slices = make_ubatch_slices(inputs.num_scheduled, 8)
    assert spans(slices) == [(0, 1, 0, 4), (1, 2, 4, 8)]
    second = slice_metadata(inputs.query_start_loc, inputs.seq_lens, slices[1])
    assert second.query_start_loc.tolist() == [0, 4] and second.seq_lens.tolist() == [4]


def test_padding_goes_to_the_last_slice_and_to_no_request() -> None:
    inputs = whole_step([2, 6], [5, 2])  # 7 real tokens, padded to 10: split at 5
    slices = make_ubatch_slices(inputs.num_scheduled, 10)
    assert spans(slices) == [(0, 1, 0, 5), (1, 2, 5, 10)]
    first, second = (slice_metadata(inputs.query_start_loc, inputs.seq_lens, s) for s in slices)
    assert first.query_start_loc.tolist() == [0, 5] and first.seq_lens.tolist() == [7]
    assert second.query_start_loc.tolist() == [0, 2] and second.seq_lens.tolist() == [8]
    assert slices[1].num_tokens - second.query_start_loc[-1] == 3  # the padding, after qsl[-1]
    # padding that pushes the default split past a request boundary: 7 real, padded to 12
    slices = make_ubatch_slices(inputs.num_scheduled, 12)
    assert spans(slices) == [(0, 2, 0, 6), (1, 2, 6, 12)]
    second = slice_metadata(inputs.query_start_loc, inputs.seq_lens, slices[1])
    assert second.query_start_loc.tolist() == [0, 1] and second.seq_lens.tolist() == [8]
    check_halves_replay_the_step(inputs, slices)


def test_an_uneven_split_point() -> None:
    inputs = whole_step([0, 3], [9, 3])
    slices = make_ubatch_slices(inputs.num_scheduled, 12, split_point=2)
    assert spans(slices) == [(0, 1, 0, 2), (0, 2, 2, 12)]
    first, second = (slice_metadata(inputs.query_start_loc, inputs.seq_lens, s) for s in slices)
    assert first.query_start_loc.tolist() == [0, 2] and first.seq_lens.tolist() == [2]
    assert second.query_start_loc.tolist() == [0, 7, 10] and second.seq_lens.tolist() == [9, 6]
    check_halves_replay_the_step(inputs, slices)


def test_three_ubatches_cut_one_request_at_both_ends() -> None:
    inputs = whole_step([1], [9])
    slices = make_ubatch_slices(inputs.num_scheduled, 9, num_ubatches=3)
    assert spans(slices) == [(0, 1, 0, 3), (0, 1, 3, 6), (0, 1, 6, 9)]
    middle = slice_metadata(inputs.query_start_loc, inputs.seq_lens, slices[1])
    assert middle.query_start_loc.tolist() == [0, 3] and middle.seq_lens.tolist() == [7]
    check_halves_replay_the_step(inputs, slices)


def test_a_split_leaving_a_slice_without_real_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="without a real token"):
        make_ubatch_slices([3, 2], 10)  # 5 real tokens, split at 5: the last has padding only
    with pytest.raises(ValueError, match="without a real token"):
        make_ubatch_slices([3, 2], 5, split_point=0)
    with pytest.raises(ValueError, match="num_tokens_padded=4"):
        make_ubatch_slices([3, 2], 4)
    with pytest.raises(ValueError, match="start inside"):
        slice_metadata(np.array([0, 3, 5]), np.array([3, 2]), UBatchSlice(slice(1, 2), slice(2, 5)))


def test_slice_metadata_leaves_the_step_untouched() -> None:
    inputs = whole_step([3, 0], [4, 4])
    for dtype in (np.int32, np.int64):  # StepInputs' int32, and int64 that numpy need not copy
        qsl, seq_lens = inputs.query_start_loc.astype(dtype), inputs.seq_lens.astype(dtype)
        for s in make_ubatch_slices(inputs.num_scheduled, 8, split_point=3):
            slice_metadata(qsl, seq_lens, s)
        assert qsl.tolist() == [0, 4, 8] and seq_lens.tolist() == [7, 4]


HEADS, DIM = 2, 8
KVCache = tuple[torch.Tensor, torch.Tensor]  # [num_blocks, 4, HEADS, DIM] each


def cache_with_context(inputs: StepInputs) -> KVCache:
    """A paged cache holding each request's context computed before the step (the same each
    call)."""
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = torch.zeros(12, 4, HEADS, DIM), torch.zeros(12, 4, HEADS, DIM)
    for i, c in enumerate(inputs.num_computed.tolist()):
        pos = np.arange(c)
        slots = torch.from_numpy(inputs.block_tables[i, pos // 4] * 4 + pos % 4)
        k, v = (torch.randn(c, HEADS, DIM, generator=gen) for _ in range(2))
        ops.write_kv(k, v, k_cache, v_cache, slots)
    return k_cache, v_cache


def write_and_attend(
    cache: KVCache,
    inputs: StepInputs,
    qkv: torch.Tensor,  # [3, T_padded, HEADS, DIM]
    s: UBatchSlice,
    qsl: np.ndarray,
    seq_lens: np.ndarray,
) -> torch.Tensor:  # [real tokens of s, HEADS, DIM]
    """One (micro-)batch as the attention layer runs it; padding tokens get slot -1."""
    tokens, num_real = s.token_slice, int(qsl[-1])
    slots = np.full(s.num_tokens, -1, np.int64)
    slots[:num_real] = inputs.slot_mapping[tokens.start : tokens.start + num_real]
    q, k, v = qkv[:, tokens]
    ops.write_kv(k, v, *cache, torch.from_numpy(slots))
    block_tables = torch.from_numpy(inputs.block_tables[s.request_slice])
    lens = (torch.from_numpy(qsl), torch.from_numpy(seq_lens))
    return ops.paged_attention(q, *cache, block_tables, *lens, 0.5)[:num_real]


def test_halves_in_turn_attend_like_the_whole_step() -> None:
    """Write + attend the halves one after the other over one paged cache: the output equals
    the whole step's (a request cut at the split sees the first half's KV in the second)."""
    inputs = whole_step([0, 5, 2], [5, 1, 8])  # 14 real tokens, padded to 16: split at 8
    qkv = torch.randn(3, 16, HEADS, DIM, generator=torch.Generator().manual_seed(0))
    whole_slice = UBatchSlice(slice(0, 3), slice(0, 14))
    qsl, seq_lens = inputs.query_start_loc, inputs.seq_lens
    whole = write_and_attend(cache_with_context(inputs), inputs, qkv, whole_slice, qsl, seq_lens)
    slices = make_ubatch_slices(inputs.num_scheduled, 16)
    assert spans(slices) == [(0, 3, 0, 8), (2, 3, 8, 16)]  # the last request spans both
    cache = cache_with_context(inputs)
    halves = []
    for s in slices:
        meta = slice_metadata(qsl, seq_lens, s)
        halves.append(write_and_attend(cache, inputs, qkv, s, *meta[:2]))
    torch.testing.assert_close(torch.cat(halves), whole)


# ---- properties --------------------------------------------------------------------------


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[int], list[int], int, int | None]:
    num_reqs = draw(st.integers(1, 6))
    computed = draw(st.lists(st.integers(0, 20), min_size=num_reqs, max_size=num_reqs))
    scheduled = draw(st.lists(st.integers(1, 12), min_size=num_reqs, max_size=num_reqs))
    total = sum(scheduled)
    assume(total >= 2)
    padded = total + draw(st.integers(0, 6))
    split = draw(st.one_of(st.none(), st.integers(1, total - 1)))
    assume(split is not None or not is_last_ubatch_empty(total, padded, 2))
    return computed, scheduled, padded, split


@settings(max_examples=200, deadline=None)
@given(batches())
def test_halves_partition_the_batch_and_see_earlier_kv(
    batch: tuple[list[int], list[int], int, int | None],
) -> None:
    computed, scheduled, padded, split = batch
    cu = np.concatenate([[0], np.cumsum(scheduled)])
    seq_lens = np.array(computed) + np.array(scheduled)
    owner = np.repeat(np.arange(len(scheduled)), scheduled)  # [T] request of each real token
    slices = make_ubatch_slices(scheduled, padded, split_point=split)
    assert [s.token_slice.start for s in slices] == [0, slices[0].token_slice.stop]
    assert slices[-1].token_slice.stop == padded
    seen: list[int] = []
    for s in slices:
        meta = slice_metadata(cu, seq_lens, s)
        reqs = np.arange(s.request_slice.start, s.request_slice.stop)
        query_lens = np.diff(meta.query_start_loc)
        assert (query_lens > 0).all() and meta.query_start_loc[0] == 0
        # the slice's real tokens, request by request, are the batch's tokens in its range
        tokens = np.repeat(reqs, query_lens)
        real_end = min(s.token_slice.stop, cu[-1])
        assert tokens.tolist() == owner[s.token_slice.start : real_end].tolist()
        assert s.num_tokens - meta.query_start_loc[-1] == s.token_slice.stop - real_end
        seen.extend(range(s.token_slice.start, s.token_slice.start + len(tokens)))
        # context of each request = its computed tokens + its tokens before this slice starts
        before = np.clip(s.token_slice.start - cu[reqs], 0, None)
        assert (meta.seq_lens - query_lens).tolist() == (np.array(computed)[reqs] + before).tolist()
        assert meta.max_query_len == query_lens.max() and meta.max_seq_len == meta.seq_lens.max()
    assert seen == list(range(int(cu[-1])))  # every real token in exactly one slice, in order
