"""The paged KV cache: per-layer K and V tensors of `[num_blocks, block_size, kv_heads, head_dim]`.

The number of blocks comes from an explicit override or from a memory budget in bytes; block 0
is the engine's null block and is allocated like any other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def bytes_per_block(
    *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """K and V bytes of one block across every layer."""
    item = torch.empty(0, dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * item


def num_blocks_for_budget(budget_bytes: int, block_bytes: int) -> int:
    num_blocks = budget_bytes // block_bytes
    if num_blocks < 2:
        raise ValueError(
            f"KV cache budget of {budget_bytes} bytes holds {num_blocks} block(s) of "
            f"{block_bytes} bytes; at least 2 are needed (block 0 is reserved)"
        )
    return int(num_blocks)


@dataclass
class KVCache:
    """Per-layer K/V page tensors, allocated once."""

    k: list[torch.Tensor]  # per layer: [num_blocks, block_size, num_kv_heads, head_dim]
    v: list[torch.Tensor]
    num_blocks: int
    block_size: int

    @classmethod
    def allocate(
        cls,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device,
    ) -> KVCache:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        return cls(k=k, v=v, num_blocks=num_blocks, block_size=block_size)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
