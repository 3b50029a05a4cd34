"""Paged attention in plain PyTorch (CPU and CUDA): gather a sequence's K/V from its blocks, then SDPA."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from agentserve.executor.attention.base import AttentionBackend, AttentionBatch


@dataclass
class _Chunk:
    begin: int  # first row of this chunk in q/k/v
    end: int
    blocks: torch.Tensor | None  # cached blocks to gather (None: no prefix, use the chunk's own k/v)
    seq_len: int
    mask: torch.Tensor | None  # [query_len, seq_len] bool, None for a causal chunk without prefix


@dataclass
class _PrefillPlan:
    slots: torch.Tensor
    chunks: list[_Chunk]


@dataclass
class _DecodePlan:
    slots: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] (padded with block 0, masked out)
    mask: torch.Tensor  # [B, 1, 1, max_blocks * block_size] bool


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Tokens of ``blocks`` ([N] or [B, N]) as ``[N * block_size, ...]`` or ``[B, N * block_size, ...]``.

    ``index_select`` on the flat block axis: on CPU it is ~10x faster than advanced indexing."""
    out = cache.index_select(0, blocks.reshape(-1))
    return out.view(*blocks.shape[:-1], -1, *cache.shape[2:])


class TorchAttention(AttentionBackend):
    """Reference backend. Decode runs GQA by folding each KV head's query group into the query axis."""

    def plan(self, batch: AttentionBatch) -> _PrefillPlan | _DecodePlan:
        slots = batch.slot_mapping.to(self.device, non_blocking=True)
        if batch.is_decode:
            return self._plan_decode(batch, slots)
        return _PrefillPlan(slots, self._plan_chunks(batch))

    def _plan_chunks(self, batch: AttentionBatch) -> list[_Chunk]:
        chunks, begin = [], 0
        for qlen, start, table in zip(batch.query_lens, batch.start_pos, batch.block_tables, strict=True):
            seq_len = start + qlen
            blocks = mask = None
            if start > 0:
                nblocks = -(-seq_len // self.block_size)
                blocks = torch.tensor(table[:nblocks], dtype=torch.int64, device=self.device)
                rows = torch.arange(start, seq_len, device=self.device)[:, None]
                mask = torch.arange(seq_len, device=self.device)[None, :] <= rows
            chunks.append(_Chunk(begin, begin + qlen, blocks, seq_len, mask))
            begin += qlen
        return chunks

    def _plan_decode(self, batch: AttentionBatch, slots: torch.Tensor) -> _DecodePlan:
        seq_lens = batch.seq_lens
        width = -(-max(seq_lens) // self.block_size)
        rows = [t[: -(-n // self.block_size)] for t, n in zip(batch.block_tables, seq_lens, strict=True)]
        padded = [r + [0] * (width - len(r)) for r in rows]
        tables = torch.tensor(padded, dtype=torch.int64).to(self.device, non_blocking=True)
        lens = torch.tensor(seq_lens, dtype=torch.int64).to(self.device, non_blocking=True)
        span = torch.arange(width * self.block_size, device=self.device)
        mask = (span[None, :] < lens[:, None])[:, None, None, :]
        return _DecodePlan(slots, tables, mask)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: _PrefillPlan | _DecodePlan,
    ) -> torch.Tensor:
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slots, k)
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slots, v)
        if isinstance(meta, _DecodePlan):
            return self._decode(q, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        for c in meta.chunks:
            out[c.begin : c.end] = self._chunk(
                q[c.begin : c.end], k[c.begin : c.end], v[c.begin : c.end], k_cache, v_cache, c
            )
        return out.view(q.shape[0], -1)

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: _DecodePlan
    ) -> torch.Tensor:
        b, group = q.shape[0], self.num_heads // self.num_kv_heads
        kc = _gather(k_cache, meta.block_tables).transpose(1, 2)  # [B, kv_heads, S, D]
        vc = _gather(v_cache, meta.block_tables).transpose(1, 2)
        qg = q.view(b, self.num_kv_heads, group, self.head_dim)
        out = F.scaled_dot_product_attention(qg, kc, vc, attn_mask=meta.mask, scale=self.scale)
        return out.reshape(b, -1)

    def _chunk(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        c: _Chunk,
    ) -> torch.Tensor:
        if c.blocks is not None:
            k = _gather(k_cache, c.blocks)[: c.seq_len]
            v = _gather(v_cache, c.blocks)[: c.seq_len]
        group = self.num_heads // self.num_kv_heads
        kh = k.transpose(0, 1).repeat_interleave(group, dim=0)  # [heads, S, D]
        vh = v.transpose(0, 1).repeat_interleave(group, dim=0)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), kh, vh, attn_mask=c.mask, is_causal=c.mask is None, scale=self.scale
        )
        return out.transpose(0, 1)
