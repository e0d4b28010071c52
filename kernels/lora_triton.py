"""Triton kernels for batched multi-LoRA (Punica's BGMV shape): the Triton path of
``kernels.lora.add_lora``.

Owns the two kernels and their wrapper ``add_lora_triton``. Each token reads its own adapter slot
(``token_slots``, ``NO_ADAPTER`` = -1 for none), so a mixed batch needs no grouping:

- shrink: ``v[t] = a[s_t] @ x[t]``, one program per (token, tile of rank rows), looping over
  ``in`` in tiles and accumulating in fp32; ``v`` is ``[T, R]`` fp32.
- expand: ``y[t] += b[s_t] @ v[t]``, one program per (token, tile of ``out``), looping over
  the rank in tiles; the sum is taken in fp32 and stored in ``y``'s dtype.

Tokens with no adapter (any negative slot) exit at once in both kernels, so their rows of ``y``
are left exactly as they were. The torch reference (``add_lora_torch``) and the slot grouping
live in ``kernels.lora``.
"""

import torch

from shoal.kernels._triton import require_triton, tl, triton


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    v_ptr,
    slots_ptr,
    dim_in,
    rank,
    x_stride_t,
    x_stride_k,
    a_stride_s,
    a_stride_r,
    a_stride_k,
    v_stride_t,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """v[t, r-tile] = a[slot, r-tile, :] @ x[t, :] in fp32, for one token and one rank tile."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot >= 0:
        rs = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = rs < rank
        a_rows = a_ptr + slot * a_stride_s + rs[:, None].to(tl.int64) * a_stride_r
        x_row = x_ptr + token * x_stride_t
        acc = tl.zeros([BLOCK_R], tl.float32)
        for k_start in range(0, dim_in, BLOCK_K):
            ks = k_start + tl.arange(0, BLOCK_K)
            k_ok = ks < dim_in
            x = tl.load(x_row + ks * x_stride_k, mask=k_ok, other=0.0).to(tl.float32)
            a = tl.load(
                a_rows + ks[None, :] * a_stride_k, mask=r_ok[:, None] & k_ok[None, :], other=0.0
            ).to(tl.float32)  # [BLOCK_R, BLOCK_K]
            acc += tl.sum(a * x[None, :], axis=1)
        tl.store(v_ptr + token * v_stride_t + rs, acc, mask=r_ok)


@triton.jit
def _lora_expand_kernel(
    v_ptr,
    b_ptr,
    y_ptr,
    slots_ptr,
    dim_out,
    rank,
    v_stride_t,
    b_stride_s,
    b_stride_n,
    b_stride_r,
    y_stride_t,
    y_stride_n,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """y[t, n-tile] += b[slot, n-tile, :] @ v[t, :], for one token and one tile of ``out``."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot >= 0:
        ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = ns < dim_out
        b_rows = b_ptr + slot * b_stride_s + ns[:, None].to(tl.int64) * b_stride_n
        v_row = v_ptr + token * v_stride_t
        acc = tl.zeros([BLOCK_N], tl.float32)
        for r_start in range(0, rank, BLOCK_R):
            rs = r_start + tl.arange(0, BLOCK_R)
            r_ok = rs < rank
            v = tl.load(v_row + rs, mask=r_ok, other=0.0)
            b = tl.load(
                b_rows + rs[None, :] * b_stride_r, mask=n_ok[:, None] & r_ok[None, :], other=0.0
            ).to(tl.float32)  # [BLOCK_N, BLOCK_R]
            acc += tl.sum(b * v[None, :], axis=1)
        y_row = y_ptr + token * y_stride_t + ns * y_stride_n
        y = tl.load(y_row, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(y_row, (y + acc).to(y_ptr.dtype.element_ty), mask=n_ok)


def add_lora_triton(
    y: torch.Tensor,  # [T, out], updated in place
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [slots, R, in]
    b: torch.Tensor,  # [slots, out, R]
    token_slots: torch.Tensor,  # [T] int32, NO_ADAPTER (-1): the row of y is left as it is
) -> None:
    """``y[t] += b[s] @ (a[s] @ x[t])`` for each token ``t`` whose slot ``s`` is not -1: a
    shrink kernel into an fp32 ``[T, R]`` buffer, then an expand kernel adding into ``y``."""
    require_triton()
    num_tokens, dim_in = x.shape
    num_slots, rank, _ = a.shape
    dim_out = y.shape[1]
    assert y.shape == (num_tokens, dim_out), f"y {tuple(y.shape)}, x {tuple(x.shape)}"
    assert a.shape == (num_slots, rank, dim_in), f"a {tuple(a.shape)}, x {tuple(x.shape)}"
    assert b.shape == (num_slots, dim_out, rank), f"b {tuple(b.shape)}, a {tuple(a.shape)}"
    assert token_slots.shape == (num_tokens,), f"token_slots {tuple(token_slots.shape)}"
    assert not token_slots.is_floating_point(), f"token_slots {token_slots.dtype}"
    assert y.dtype == x.dtype, f"y {y.dtype}, x {x.dtype}"
    assert a.dtype == b.dtype, f"a {a.dtype}, b {b.dtype}"
    assert x.device == y.device == a.device == b.device == token_slots.device
    if num_tokens == 0 or rank == 0 or dim_out == 0:
        return
    slots = token_slots.to(torch.int32)
    v = torch.empty((num_tokens, rank), dtype=torch.float32, device=x.device)
    block_r = min(32, max(16, triton.next_power_of_2(rank)))
    block_k = min(128, max(16, triton.next_power_of_2(dim_in)))
    block_n = min(64, max(16, triton.next_power_of_2(dim_out)))
    _lora_shrink_kernel[(num_tokens, triton.cdiv(rank, block_r))](
        x, a, v, slots,
        dim_in, rank,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), v.stride(0),
        BLOCK_R=block_r, BLOCK_K=block_k,
    )  # fmt: skip
    _lora_expand_kernel[(num_tokens, triton.cdiv(dim_out, block_n))](
        v, b, y, slots,
        dim_out, rank,
        v.stride(0), b.stride(0), b.stride(1), b.stride(2), y.stride(0), y.stride(1),
        BLOCK_N=block_n, BLOCK_R=block_r,
    )  # fmt: skip
