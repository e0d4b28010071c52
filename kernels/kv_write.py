"""Writing this step's keys and values into the paged KV cache (torch reference and Triton).

A slot is ``block_id * block_size + offset``; a negative slot means "do not write" (padding or a
token whose KV is not kept).
"""

import torch

from shoal.kernels._triton import require_triton, tl, triton


def write_kv_torch(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Scatter key/value rows into their cache slots, in place."""
    keep = slot_mapping >= 0  # [num_tokens]
    slots = slot_mapping[keep]
    num_blocks, block_size = k_cache.shape[:2]
    k_flat = k_cache.view(num_blocks * block_size, *k_cache.shape[2:])
    v_flat = v_cache.view(num_blocks * block_size, *v_cache.shape[2:])
    k_flat.index_copy_(0, slots, key[keep].to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value[keep].to(v_cache.dtype))


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    key_stride_t,
    key_stride_h,
    value_stride_t,
    value_stride_h,
    cache_stride_block,
    cache_stride_slot,
    cache_stride_head,
    block_size,
    num_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        block = slot // block_size
        offset = slot % block_size
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < num_kv_heads) & (dims < head_dim)
        src_k = key_ptr + token * key_stride_t + heads * key_stride_h + dims
        src_v = value_ptr + token * value_stride_t + heads * value_stride_h + dims
        dst = block * cache_stride_block + offset * cache_stride_slot + heads * cache_stride_head
        k = tl.load(src_k, mask=mask)
        v = tl.load(src_v, mask=mask)
        tl.store(k_cache_ptr + dst + dims, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst + dims, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton version of :func:`write_kv_torch` (key/value may be strided views)."""
    require_triton()
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, f"value {tuple(value.shape)} != key {tuple(key.shape)}"
    assert k_cache.dim() == 4 and k_cache.shape[2:] == (num_kv_heads, head_dim), k_cache.shape
    assert v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride()
    assert k_cache.stride(3) == 1 and key.stride(2) == 1 and value.stride(2) == 1
    assert k_cache.dtype == v_cache.dtype and key.dtype == value.dtype
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.shape[1],
        num_kv_heads,
        head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
