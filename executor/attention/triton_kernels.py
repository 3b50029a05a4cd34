"""Triton kernels that attend the paged KV cache in place (no gathered copy of any sequence's keys).

The cache layout is :mod:`agentserve.executor.kv_cache`'s: per layer K and V ``[num_blocks, block_size,
kv_heads, head_dim]``.  Every kernel finds a key position ``p`` of sequence ``b`` at block
``block_tables[b, p // block_size]``, row ``p % block_size``, so any block size works (1 .. 64 tokens and
beyond, powers of two or not) and a sequence's blocks may lie anywhere in the cache.

- :func:`paged_decode`: one query token per sequence.  A program owns one sequence, one KV head and one
  *split* of the sequence's keys, and attends all ``group`` query heads of that KV head at once (GQA: each
  key is loaded once per group, not once per query head).  Splits (split-K, as FlashDecoding) keep the GPU
  busy when a few sequences have long contexts; a second kernel merges them by their log-sum-exp.  The
  split count is a compile-time constant while each sequence derives its own split length from its length,
  so one compiled kernel (and one CUDA graph) serves every mix of lengths; empty splits end at once.
- :func:`paged_prefill`: ``query_lens[b]`` new tokens of sequence ``b`` at positions ``start_pos[b] ..``,
  causal within the chunk, attending the cached prefix; rows of a program are (token, group head) pairs.
- :func:`store_kv`: writes new tokens' K/V into their slots; a negative slot is skipped (padding rows of a
  CUDA-graph batch).

Softmax runs online in fp32 in base 2 (scores pre-multiplied by ``scale * log2(e)``).  Head sizes that are
not a power of two are padded to one with masked loads.  ``tl.dot`` needs every dimension >= 16 on a GPU, so
the query-row and head tiles are at least 16 wide.  fp32 caches use IEEE dot products (no TF32).
Under ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (slowly): that is how CI tests them.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # the kernels below were made for the interpreter
LOG2E = 1.4426950408889634
MIN_TILE = 16  # tl.dot's smallest dimension on a GPU


def pow2_at_least(n: int, floor: int = MIN_TILE) -> int:
    """The smallest power of two >= ``max(n, floor)``."""
    return max(floor, triton.next_power_of_2(max(1, n)))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _upcast_dot(dtype: torch.dtype) -> bool:
    """Triton's interpreter multiplies bf16 operands wrongly (numpy has no bf16): widen them to fp32 there."""
    return dtype == torch.bfloat16 and INTERPRETED


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _attend_chunk(
    q, acc, m, denom, k_cache, v_cache, table_row, pos, end, q_pos, kvh, dims, dmask, qk_scale,
    stride_kb, stride_ks, stride_kh,
    PAGE: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """One online-softmax step: the rows of ``q`` against keys ``pos`` (those < ``end``; with ``CAUSAL`` only
    those <= each row's ``q_pos``) read through the block table row ``table_row``."""
    pmask = pos < end
    blk = tl.load(table_row + pos // PAGE, mask=pmask, other=0).to(tl.int64)
    kv_row = blk * stride_kb + (pos % PAGE) * stride_ks + kvh * stride_kh
    kv_mask = pmask[:, None] & dmask[None, :]
    k = tl.load(k_cache + kv_row[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    s = _dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale
    visible = pmask[None, :]
    if CAUSAL:
        visible = visible & (pos[None, :] <= q_pos[:, None])
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    v = tl.load(v_cache + kv_row[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
    return acc, m_new, denom * alpha + tl.sum(p, 1)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache, v_cache, block_tables, seq_lens, part_out, part_lse, qk_scale,
    stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_pb, stride_ph,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + b)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, D_PAD)
    hmask = heads < GROUP
    dmask = dims < HEAD_DIM
    q_off = b * stride_qb + (kvh * GROUP + heads)[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=hmask[:, None] & dmask[None, :], other=0.0)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_PAD], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        acc, m, denom = _attend_chunk(
            q, acc, m, denom, k_cache, v_cache, block_tables + b * stride_bt, start + tl.arange(0, BLOCK_N), hi, 0,
            kvh, dims, dmask, qk_scale, stride_kb, stride_ks, stride_kh, PAGE, False, PRECISION, UPCAST,
        )

    filled = denom > 0.0
    out = acc / tl.where(filled, denom, 1.0)[:, None]
    lse = tl.where(filled, m + tl.log2(tl.where(filled, denom, 1.0)), float("-inf"))
    head_rows = b * stride_pb + (kvh * GROUP + heads) * stride_ph + split
    tl.store(part_lse + head_rows, lse, mask=hmask)
    tl.store(part_out + head_rows[:, None] * D_PAD + dims[None, :], out, mask=hmask[:, None])


@triton.jit
def _decode_merge_kernel(
    part_out, part_lse, out_ptr, stride_pb, stride_ph, stride_ob,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    splits = tl.arange(0, S_PAD)
    dims = tl.arange(0, D_PAD)
    smask = splits < NUM_SPLITS
    base = b * stride_pb + h * stride_ph + splits
    lse = tl.load(part_lse + base, mask=smask, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # an empty sequence (graph padding): output 0
    w = tl.exp2(lse - top)
    parts = tl.load(part_out + base[:, None] * D_PAD + dims[None, :], mask=smask[:, None], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, num_splits: int, block_n: int = 32, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of ``q`` ([B, heads, D]) over the paged cache; returns ``[B, heads * D]``.

    ``block_tables``: [B, >= max blocks] int32; ``seq_lens``: [B] int32 (keys per row, 0 gives a zero row).
    """
    b, heads, d = q.shape
    _, page, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    d_pad = pow2_at_least(d)
    part_out = torch.empty(b, heads, num_splits, d_pad, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(b, heads, num_splits, dtype=torch.float32, device=q.device)
    out = torch.empty(b, heads * d, dtype=q.dtype, device=q.device) if out is None else out
    if b == 0:
        return out
    _decode_split_kernel[(b, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_out, part_lse, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        part_lse.stride(0), part_lse.stride(1),
        GROUP=group, HEAD_DIM=d, D_PAD=d_pad, BLOCK_H=pow2_at_least(group), PAGE=page, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, PRECISION=_precision(q.dtype), UPCAST=_upcast_dot(q.dtype), num_warps=4,
    )
    _decode_merge_kernel[(b, heads)](
        part_out, part_lse, out, part_lse.stride(0), part_lse.stride(1), out.stride(0),
        HEAD_DIM=d, D_PAD=d_pad, NUM_SPLITS=num_splits, S_PAD=pow2_at_least(num_splits, 1), num_warps=4,
    )
    return out


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache, v_cache, out_ptr, block_tables, cu_query, start_pos, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_bt,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    tile = tl.program_id(2)
    row0 = tl.load(cu_query + b)
    qlen = tl.load(cu_query + b + 1) - row0
    if tile * BLOCK_Q >= qlen:
        return
    start = tl.load(start_pos + b)

    rows = tl.arange(0, BLOCK_Q * G_PAD)  # row r: token r // G_PAD of the tile, head r % G_PAD of the group
    tok = tile * BLOCK_Q + rows // G_PAD
    head = kvh * GROUP + rows % G_PAD
    rmask = (tok < qlen) & (rows % G_PAD < GROUP)
    dims = tl.arange(0, D_PAD)
    dmask = dims < HEAD_DIM
    q_off = (row0 + tok)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=rmask[:, None] & dmask[None, :], other=0.0)
    q_pos = start + tok  # keys at positions <= q_pos are visible (causal, bottom-right aligned)

    m = tl.full([BLOCK_Q * G_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_Q * G_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * G_PAD, D_PAD], tl.float32)
    kv_end = start + tl.minimum(qlen, (tile + 1) * BLOCK_Q)
    for k0 in range(0, kv_end, BLOCK_N):
        acc, m, denom = _attend_chunk(
            q, acc, m, denom, k_cache, v_cache, block_tables + b * stride_bt, k0 + tl.arange(0, BLOCK_N), kv_end,
            q_pos, kvh, dims, dmask, qk_scale, stride_kb, stride_ks, stride_kh, PAGE, True, PRECISION, UPCAST,
        )

    out = acc / tl.where(denom > 0.0, denom, 1.0)[:, None]
    o_off = (row0 + tok)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


def prefill_block_q(group: int, rows: int = 64) -> int:
    """Query tokens per prefill program: ``rows`` (token, head) rows, at least one token."""
    return max(1, rows // pow2_at_least(group, 1))


def paged_prefill(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    cu_query: torch.Tensor, start_pos: torch.Tensor, max_query_len: int, scale: float,
    block_q: int | None = None, block_n: int = 32,
) -> torch.Tensor:
    """Prefill attention of ``q`` ([T, heads, D], sequences back to back as ``cu_query`` [B + 1] int32 says)
    over the paged cache, which already holds the new tokens' K/V; returns ``[T, heads * D]``."""
    t, heads, d = q.shape
    _, page, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    g_pad = pow2_at_least(group, 1)
    block_q = block_q or prefill_block_q(group)
    block_q = max(block_q, MIN_TILE // g_pad)  # tl.dot's rows
    out = torch.empty(t, heads, d, dtype=q.dtype, device=q.device)
    batch = cu_query.numel() - 1
    if t == 0 or batch == 0:
        return out.view(t, heads * d)
    _prefill_kernel[(batch, kv_heads, triton.cdiv(max_query_len, block_q))](
        q, k_cache, v_cache, out, block_tables, cu_query, start_pos, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, G_PAD=g_pad, HEAD_DIM=d, D_PAD=pow2_at_least(d), BLOCK_Q=block_q, PAGE=page,
        BLOCK_N=block_n, PRECISION=_precision(q.dtype), UPCAST=_upcast_dot(q.dtype), num_warps=4,
    )
    return out.view(t, heads * d)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache, v_cache, slots, stride_kt, stride_vt, stride_cs,
    WIDTH: tl.constexpr, W_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slots + t).to(tl.int64)
    if slot < 0:
        return
    cols = tl.arange(0, W_PAD)
    cmask = cols < WIDTH
    tl.store(k_cache + slot * stride_cs + cols, tl.load(k_ptr + t * stride_kt + cols, mask=cmask), mask=cmask)
    tl.store(v_cache + slot * stride_cs + cols, tl.load(v_ptr + t * stride_vt + cols, mask=cmask), mask=cmask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Write ``k``/``v`` ([T, kv_heads, D], each token's heads contiguous) into flat ``slots`` ([T]; < 0: skip)."""
    t, kv_heads, d = k.shape
    if t == 0:
        return
    width = kv_heads * d
    k, v = k.reshape(t, width), v.reshape(t, width)
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slots, k.stride(0), v.stride(0), k_cache.stride(1),
        WIDTH=width, W_PAD=pow2_at_least(width, 1), num_warps=4,
    )
