"""The attention backend interface.

A forward pass is described once by an :class:`AttentionBatch` (built by the runner from block tables),
turned into backend metadata by :meth:`AttentionBackend.plan`, and then used by every layer:
:meth:`AttentionBackend.forward` writes the new tokens' K/V into their cache slots and returns the
attention output of the new tokens.

Prefill: ``query_lens[i]`` new tokens of sequence ``i`` at positions ``start_pos[i] ..``; they attend to the
sequence's cached prefix ``0 .. start_pos[i] - 1`` and causally within the chunk.  Decode is the special
case of one new token per sequence (``is_decode``), which backends may run through a faster path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class AttentionBatch:
    """Shape of one forward pass. Token ``j`` of sequence ``i`` is row ``cu_query[i] + j`` of q/k/v."""

    is_decode: bool
    query_lens: list[int]
    start_pos: list[int]  # tokens already cached for each sequence
    block_tables: list[list[int]]  # blocks covering positions 0 .. start_pos + query_len - 1
    slot_mapping: torch.Tensor  # [num_tokens] int64 flat cache slot of each new token

    @property
    def seq_lens(self) -> list[int]:
        return [s + q for s, q in zip(self.start_pos, self.query_lens, strict=True)]


class AttentionBackend(ABC):
    """Paged attention for one model shape; stateless across forward passes."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, device: torch.device
    ) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size, self.device = block_size, device
        self.scale = head_dim**-0.5

    @abstractmethod
    def plan(self, batch: AttentionBatch) -> Any:
        """Precompute whatever every layer of this forward pass needs (index tensors, masks)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: Any,
    ) -> torch.Tensor:
        """Store k/v ([T, kv_heads, head_dim]) in the cache and attend q ([T, heads, head_dim]).

        Returns ``[T, heads * head_dim]``.
        """

    def prefill_query_dtype(self, meta: Any) -> torch.dtype | None:
        """The dtype this plan's queries are all attended in, where :meth:`forward` rounds every query row to one
        (handing them over rounded gives the same result, one pass fewer); ``None``: attended as given."""
        return None

    def warmup_batches(self, num_blocks: int) -> list[AttentionBatch]:
        """One batch of each kind a step can be, in the first blocks of the cache (identity tables, so a
        position's slot is the position): a decode, a prefill after a cached prefix, and, where the cache
        has room, a decode batch sharing a cascade-sized prefix."""
        from agentserve.executor.attention import cascade

        bs = self.block_size
        batches = [AttentionBatch(True, [1], [0], [[0]], torch.tensor([0]))]
        if num_blocks * bs >= 5:
            batches.append(AttentionBatch(False, [3], [2], [list(range(-(-5 // bs)))], torch.arange(2, 5)))
        shared = -(-cascade.MIN_SHARED_TOKENS // bs)
        if num_blocks >= shared + 2:
            tables = [list(range(shared)) + [shared + i] for i in range(2)]
            batches.append(AttentionBatch(True, [1, 1], [shared * bs] * 2, tables,
                                          torch.tensor([t[-1] * bs for t in tables])))
        return batches

    def warmup(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Run every :meth:`warmup_batches` kind once (kernels compile before serving); writes zeros into the
        first blocks of ``k_cache`` / ``v_cache``, so call it before any sequence is cached."""
        for batch in self.warmup_batches(k_cache.shape[0]):
            t = len(batch.slot_mapping)
            q = k_cache.new_zeros(t, self.num_heads, self.head_dim)
            kv = k_cache.new_zeros(t, self.num_kv_heads, self.head_dim)
            self.forward(q, kv, kv, k_cache, v_cache, self.plan(batch))
