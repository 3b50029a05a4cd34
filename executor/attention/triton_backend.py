"""Paged attention with Triton kernels (:mod:`.triton_kernels`): K/V read in place from their blocks.

The default on CUDA where FlashInfer is not installed: it needs nothing beyond a CUDA PyTorch, which ships
Triton.  ``plan`` turns the batch's block tables into a few small int32 tensors once per forward pass; every
layer then runs one store kernel and one attention call (decode: split-K plus a merge; prefill and mixed
steps: one causal kernel over the ragged batch, decodes riding in it as one-token chunks).

On a CPU it runs only under Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton is imported):
slow, and meant for tests.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

from agentserve.executor.attention.base import AttentionBackend, AttentionBatch

MIN_SPLIT_TOKENS = 256  # a decode split never covers fewer keys than this (one split below it)
MAX_SPLITS = 16
PROGRAMS_PER_SM = 2  # decode splits aim for this many (sequence, KV head, split) programs per SM


def interpreting() -> bool:
    """True when our kernels run in Triton's CPU interpreter: ``TRITON_INTERPRET=1`` when they were imported."""
    kernels = sys.modules.get("agentserve.executor.attention.triton_kernels")
    return kernels.INTERPRETED if kernels is not None else os.environ.get("TRITON_INTERPRET") == "1"


def choose_num_splits(batch: int, kv_heads: int, max_len: int, sm_count: int, min_split_tokens: int = MIN_SPLIT_TOKENS,
                      max_splits: int = MAX_SPLITS) -> int:
    """Splits per sequence for a decode step: enough programs to fill ``sm_count`` SMs, none shorter than
    ``min_split_tokens`` keys; a power of two (each value is a separately compiled kernel)."""
    programs = max(1, batch * kv_heads)
    want = min(-(-PROGRAMS_PER_SM * sm_count // programs), -(-max_len // min_split_tokens), max_splits)
    splits = 1
    while splits * 2 <= want:
        splits *= 2
    return splits


@dataclass
class TritonDecodePlan:
    slots: torch.Tensor  # [B] int64 flat cache slot of each new token (< 0: skipped)
    block_tables: torch.Tensor  # [B, W] int32, rows padded with block 0 past their last block
    seq_lens: torch.Tensor  # [B] int32 keys of each row, the new token included
    num_splits: int


@dataclass
class TritonPrefillPlan:
    slots: torch.Tensor
    block_tables: torch.Tensor
    cu_query: torch.Tensor  # [B + 1] int32 first row of each sequence in q
    start_pos: torch.Tensor  # [B] int32 tokens cached before the chunk
    max_query_len: int


def padded_tables(tables: list[list[int]], seq_lens: list[int], block_size: int) -> list[list[int]]:
    """Each table cut to the blocks its sequence uses, padded with block 0 to the longest."""
    rows = [t[: -(-n // block_size)] for t, n in zip(tables, seq_lens, strict=True)]
    width = max(1, max(len(r) for r in rows))
    return [r + [0] * (width - len(r)) for r in rows]


class TritonAttention(AttentionBackend):
    """Paged decode and prefill in Triton. ``sm_count`` sizes decode splits (default: the device's)."""

    def __init__(self, *args, sm_count: int | None = None, min_split_tokens: int = MIN_SPLIT_TOKENS,
                 max_splits: int = MAX_SPLITS, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from agentserve.executor.attention import triton_kernels  # imports Triton

        self.kernels = triton_kernels
        if sm_count is None:
            sm_count = torch.cuda.get_device_properties(self.device).multi_processor_count \
                if self.device.type == "cuda" else 1
        self.sm_count, self.min_split_tokens, self.max_splits = sm_count, min_split_tokens, max_splits

    def _int32(self, rows: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.int32).to(self.device, non_blocking=True)

    def plan(self, batch: AttentionBatch) -> TritonDecodePlan | TritonPrefillPlan:
        slots = batch.slot_mapping.to(self.device, non_blocking=True)
        seq_lens = batch.seq_lens
        tables = self._int32(padded_tables(batch.block_tables, seq_lens, self.block_size))
        if batch.is_decode:
            splits = choose_num_splits(len(seq_lens), self.num_kv_heads, max(seq_lens), self.sm_count,
                                       self.min_split_tokens, self.max_splits)
            return TritonDecodePlan(slots, tables, self._int32(seq_lens), splits)
        cu = [0]
        for n in batch.query_lens:
            cu.append(cu[-1] + n)
        return TritonPrefillPlan(slots, tables, self._int32(cu), self._int32(batch.start_pos), max(batch.query_lens))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: TritonDecodePlan | TritonPrefillPlan) -> torch.Tensor:
        kern = self.kernels
        kern.store_kv(k, v, k_cache, v_cache, meta.slots)
        q = q if q.stride(-1) == 1 else q.contiguous()
        if isinstance(meta, TritonDecodePlan):
            return kern.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, self.scale,
                                     meta.num_splits)
        return kern.paged_prefill(q, k_cache, v_cache, meta.block_tables, meta.cu_query, meta.start_pos,
                                  meta.max_query_len, self.scale)

    def warmup(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Compile every kernel variant a step can launch: each kind of batch, then each decode split count."""
        super().warmup(k_cache, v_cache)
        q = k_cache.new_zeros(1, self.num_heads, self.head_dim)
        table = torch.zeros(1, 1, dtype=torch.int32, device=self.device)
        lens = torch.ones(1, dtype=torch.int32, device=self.device)
        splits = 2
        while splits <= self.max_splits:
            self.kernels.paged_decode(q, k_cache, v_cache, table, lens, self.scale, splits)
            splits *= 2
