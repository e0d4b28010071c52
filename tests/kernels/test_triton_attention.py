"""Paged attention Triton kernels (under TRITON_INTERPRET=1) against the torch references."""

import pytest
import torch

from shoal.kernels import ops
from shoal.kernels.decode_attention import decode_attention_torch, decode_attention_triton
from shoal.kernels.varlen_attention import varlen_attention_torch, varlen_attention_triton
from tests.kernels.paged_case import make_paged_case, naive_attention

# (query_lens, context_lens): fresh prefill, decode, chunk over an unaligned prefix, a chunk
# longer than one query tile (17 > 16) over a prefix, and a decode at a page boundary.
MIXED = ([5, 1, 9, 17, 1], [0, 30, 12, 40, 31])
DECODE = ([1, 1, 1, 1], [0, 33, 14, 64])


def _run(case, fn, **kwargs):
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.query_start_loc)
    return fn(*args, case.seq_lens, case.scale, **kwargs)


@pytest.mark.parametrize("gqa", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("lens", [MIXED, DECODE], ids=["mixed", "decode"])
def test_paged_attention_triton_matches_reference(monkeypatch, gqa, head_dim, block_size, lens):
    """``ops.paged_attention`` forced to Triton (decode kernel for the all-decode batch, varlen
    kernel for the mixed one) against the torch path."""
    monkeypatch.setenv("SHOAL_KERNELS", "triton")
    case = make_paged_case(*lens, num_kv_heads=2, gqa=gqa, head_dim=head_dim, block_size=block_size)
    expected = _run(case, varlen_attention_torch)
    out = _run(case, ops.paged_attention)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_kernel_matches_decode_reference(gqa, block_size, num_splits):
    case = make_paged_case(
        [1, 1, 1], [70, 2, 33], num_kv_heads=2, gqa=gqa, head_dim=64, block_size=block_size
    )
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale)
    out = decode_attention_triton(*args, num_splits=num_splits, block_n=16)
    torch.testing.assert_close(out, decode_attention_torch(*args), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(("block_size", "block_n"), [(8, 16), (12, 32), (16, 64), (32, 16)])
def test_key_tiles_may_span_or_split_pages(block_size, block_n):
    case = make_paged_case(*MIXED, num_kv_heads=2, gqa=2, head_dim=64, block_size=block_size)
    expected = naive_attention(case)
    out = _run(case, varlen_attention_triton, max_query_len=17, block_n=block_n)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    decodes = make_paged_case(*DECODE, num_kv_heads=2, gqa=2, head_dim=64, block_size=block_size)
    args = (decodes.q, decodes.k_cache, decodes.v_cache, decodes.block_tables, decodes.seq_lens)
    out = decode_attention_triton(*args, decodes.scale, num_splits=2, block_n=block_n)
    torch.testing.assert_close(out, naive_attention(decodes), atol=2e-5, rtol=1e-5)


def test_decode_kernel_directly_with_one_kv_head_and_long_context():
    case = make_paged_case([1, 1], [100, 3], num_kv_heads=1, gqa=4, head_dim=64, block_size=16)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale)
    torch.testing.assert_close(
        decode_attention_triton(*args), naive_attention(case), atol=2e-5, rtol=1e-5
    )


@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("num_splits", [2, 3])
def test_split_context_decode_merges_partials(gqa, num_splits):
    # the 3-token sequence leaves later splits empty; the 100-token one spans all of them
    case = make_paged_case(
        [1, 1, 1], [100, 2, 50], num_kv_heads=2, gqa=gqa, head_dim=64, block_size=16
    )
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale)
    out = decode_attention_triton(*args, max_seq_len=101, num_splits=num_splits)
    torch.testing.assert_close(out, naive_attention(case), atol=2e-5, rtol=1e-5)


def test_varlen_kernel_handles_decodes_and_many_query_tiles():
    case = make_paged_case(
        [1, 40, 2], [20, 5, 0], num_kv_heads=2, gqa=2, head_dim=64, block_size=16
    )
    out = _run(case, varlen_attention_triton, max_query_len=40)
    torch.testing.assert_close(out, naive_attention(case), atol=2e-5, rtol=1e-5)


def test_dispatch_forced_to_triton(monkeypatch):
    monkeypatch.setenv("SHOAL_KERNELS", "triton")
    case = make_paged_case(*MIXED, num_kv_heads=2, gqa=2, head_dim=64, block_size=16)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.query_start_loc)
    out = ops.paged_attention(*args, case.seq_lens, case.scale, max_query_len=17)
    torch.testing.assert_close(out, naive_attention(case), atol=2e-5, rtol=1e-5)


def test_wrapper_rejects_mismatched_dtypes():
    case = make_paged_case(*DECODE, num_kv_heads=2, gqa=2, head_dim=64, block_size=16)
    with pytest.raises(AssertionError, match="cache"):
        decode_attention_triton(
            case.q.double(), case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 1.0
        )
