"""Helpers shared by the paged attention paths: input checks, the dot precision, the Triton
key-tile loader, and how the torch path reads each sequence's context out of the pages."""

from dataclasses import dataclass

import torch

from shoal.kernels._triton import tl, triton


@dataclass
class ContextReads:
    """How to read each sequence's context: a view of the cache when its pages are consecutive
    block ids (common: the block pool hands out runs), else a slice of one packed gather."""

    seq_lens: list[int]
    first_page: list[int]  # for consecutive runs; -1 for gathered sequences
    gathered_start: list[int]  # slot in the packed gather; -1 for consecutive runs
    gathered_pages: torch.Tensor  # [num_gathered_pages] int64 block ids


def plan_context_reads(
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: list[int],
    block_size: int,
) -> ContextReads:
    """Decide, with one host read of the tables, which sequences need a gather."""
    device = block_tables.device
    used = torch.tensor([-(-n // block_size) for n in seq_lens], device=device)  # [num_seqs]
    columns = torch.arange(block_tables.shape[1], device=device)
    in_use = columns[None, :] < used[:, None]  # [num_seqs, max_blocks]
    steps_ok = (block_tables[:, 1:] - block_tables[:, :-1] == 1) | ~in_use[:, 1:]
    consecutive = steps_ok.all(dim=1) & (used > 0)
    first = torch.where(consecutive, block_tables[:, 0].long(), -1).tolist()
    gathered_pages = block_tables[in_use & ~consecutive[:, None]].long()  # seq by seq
    starts, offset = [], 0
    for seq_len, first_page in zip(seq_lens, first, strict=True):
        starts.append(-1 if first_page >= 0 else offset)
        if first_page < 0:
            offset += -(-seq_len // block_size) * block_size
    return ContextReads(seq_lens, first, starts, gathered_pages)


def read_contexts(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    plan: ContextReads,
) -> list[torch.Tensor]:  # per sequence [seq_len, num_kv_heads, head_dim]
    """Each sequence's context, as views (consecutive pages) or slices of one gather."""
    block_size = cache.shape[1]
    packed = cache.index_select(0, plan.gathered_pages).flatten(0, 1)
    contexts = []
    for seq_len, first_page, start in zip(
        plan.seq_lens, plan.first_page, plan.gathered_start, strict=True
    ):
        if first_page >= 0:
            pages = cache[first_page : first_page + -(-seq_len // block_size)]
            contexts.append(pages.flatten(0, 1)[:seq_len])
        else:
            contexts.append(packed[start : start + seq_len])
    return contexts


def check_paged_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor
) -> None:
    """Shape, stride and dtype checks shared by the paged attention kernels."""
    assert q.dim() == 3 and q.is_contiguous(), f"q must be [T, heads, dim], got {tuple(q.shape)}"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "k/v caches differ in shape"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    assert q.shape[2] == k_cache.shape[3], f"head_dim {q.shape[2]} != cache {k_cache.shape[3]}"
    assert q.shape[1] % k_cache.shape[2] == 0, "num_q_heads must be a multiple of num_kv_heads"
    assert q.dtype == k_cache.dtype == v_cache.dtype, f"{q.dtype} vs cache {k_cache.dtype}"
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1


def dot_precision(dtype: torch.dtype) -> str:
    """Exact fp32 products for fp32 inputs (no TF32); the default for half types."""
    return "ieee" if dtype == torch.float32 else "tf32"


def default_block_n(device: torch.device) -> int:
    """Keys per attention tile: 64 on the GPU; 32 in the interpreter (tests)."""
    return 64 if device.type == "cuda" else 32


@triton.jit
def load_kv_tile(
    k_cache_ptr,
    v_cache_ptr,
    table_row_ptr,  # this sequence's block table row
    keys,  # [BLOCK_N] key positions
    key_ok,  # [BLOCK_N] which positions to read
    head_offset,  # kv_head * cache_stride_head
    dims,  # [BLOCK_D]
    dim_ok,
    cache_stride_block,
    cache_stride_slot,
    PAGE: tl.constexpr,
):
    """K and V ``[BLOCK_N, BLOCK_D]`` for any key positions, each looked up in the block table
    (so a tile may span pages of any size)."""
    blocks = tl.load(table_row_ptr + keys // PAGE, mask=key_ok, other=0).to(tl.int64)
    rows = blocks * cache_stride_block + (keys % PAGE) * cache_stride_slot + head_offset
    offsets = rows[:, None] + dims[None, :]
    mask = key_ok[:, None] & dim_ok[None, :]
    k = tl.load(k_cache_ptr + offsets, mask=mask, other=0.0)
    v = tl.load(v_cache_ptr + offsets, mask=mask, other=0.0)
    return k, v
