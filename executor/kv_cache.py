"""The paged KV cache: per layer one K and one V tensor ``[num_blocks, block_size, kv_heads, head_dim]``.

Token at position ``p`` of a sequence with block table ``bt`` lives in block ``bt[p // block_size]`` at
offset ``p % block_size``; its flat slot is ``bt[p // block_size] * block_size + p % block_size``.
Which blocks a sequence owns is decided by the caller (the orchestrator's block manager).
"""

from __future__ import annotations

import torch


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes across all layers, K and V together."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


class KVCache:
    """Preallocated paged K/V storage, zero-filled: masked padding slots must never hold NaN."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"KV cache needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.bytes_per_block = bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)

    @classmethod
    def from_budget(
        cls,
        budget_bytes: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        """As many blocks as fit in ``budget_bytes`` (at least one)."""
        per_block = bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
        return cls(
            num_layers, max(1, budget_bytes // per_block), block_size, num_kv_heads, head_dim, dtype, device
        )

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block
