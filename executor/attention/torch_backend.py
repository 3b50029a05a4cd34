"""Paged attention in plain PyTorch (CPU and CUDA): gather a sequence's K/V from its blocks, then attend.

Decode on a CPU in fp32 runs the compiled paged-decode kernel where one was given (:mod:`.cpu_kernel`:
keys read in place from their blocks).  Otherwise it uses ``scaled_dot_product_attention`` on gathered
K/V, each KV head's query group folded into query rows (4-D, no repeated K/V); on CPU a prefix of blocks
shared by the whole batch (agents' common system prompt) is then attended once for all of it
(:mod:`.cascade`).  On CUDA the gathers of one forward pass go into buffers made by its first layer and
reused by every later one (:class:`GatherBuffers`), so no layer allocates a copy of the batch's KV.

Prefill on CUDA calls SDPA with 4-D ``[1, heads, L, D]`` queries against ``[1, kv_heads, S, D]`` keys and
``enable_gqa``, causal (bottom-right aligned after a cached prefix), so its fused kernels run and K/V are
never repeated per query head.  On CPU it calls SDPA's flash kernel directly with each KV head's query group
folded into rows (K/V read once per group), in query blocks of at most :data:`CPU_ROW_BLOCK` rows: each
block attends the keys before its first row (cached prefix, earlier rows) unmasked and its own rows' keys
under an additive causal mask, the two merged by log-sum-exp (on bf16 copies where ``prefill_dtype`` says so:
PyTorch runs them on AMX tiles, each call on padded shapes from a bounded set; an fp16 cache's blocks gathered
as bf16 in one pass by :mod:`.cpu_gather` where given) — or, where a prefill kernel was given
(:mod:`.cpu_prefill`: bf16 dot products on AVX512-BF16 CPUs), each chunk of more than one token attends its keys
in place through that kernel.  The Triton backend (:mod:`.triton_backend`) replaces this path
on CUDA by default.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from agentserve.executor.attention import cascade
from agentserve.executor.attention.base import AttentionBackend, AttentionBatch
from agentserve.executor.linear import bf16_forward

if TYPE_CHECKING:
    from agentserve.executor.attention.cpu_gather import Bf16Gather
    from agentserve.executor.attention.cpu_kernel import PagedDecodeKernel
    from agentserve.executor.attention.cpu_prefill import PagedPrefillKernel

CPU_ROW_BLOCK = 256  # query rows per block: each block's causal mask covers its own rows' keys only
ROW_PAD = 16  # bf16 CPU prefill: a block's query rows rounded up to this (bounded kernel shapes, _flash_chunk)
KEY_PAD = 64  # bf16 CPU prefill: the keys of each attention call rounded down (unmasked) or up (masked) to this


@dataclass
class _Chunk:
    begin: int  # first row of this chunk in q/k/v
    end: int
    start: int  # tokens of this sequence cached before the chunk
    blocks: torch.Tensor | None  # cached blocks to gather (None: no prefix, use the chunk's own k/v)
    kernel: bool = False  # attended by the prefill kernel (``blocks`` then covers the chunk's own keys too)


class GatherBuffers:
    """Gathers of one forward pass into buffers its first layer allocates and every later layer reuses.

    Layers have caches of one shape, so the ``key``-th gather of every layer has one shape.  ``None`` where
    a fresh tensor per gather is wanted (CPU: the numerics and speed measured there are of that path)."""

    def __init__(self) -> None:
        self._bufs: dict[object, torch.Tensor] = {}

    def gather(self, key: object, cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        out = self._bufs.get(key)
        if out is None:
            out = self._bufs[key] = torch.empty((blocks.numel(), *cache.shape[1:]), dtype=cache.dtype,
                                                device=cache.device)
        torch.index_select(cache, 0, blocks.reshape(-1), out=out)
        return out.view(*blocks.shape[:-1], -1, *cache.shape[2:])


@dataclass
class _PrefillPlan:
    slots: torch.Tensor
    chunks: list[_Chunk]  # chunks attended one by one
    decode_rows: torch.Tensor | None = None  # rows of one-token continuations, attended as a decode batch
    decode: _DecodePlan | None = None
    buffers: GatherBuffers | None = None  # reused gathers (CUDA), else None


@dataclass
class _DecodePlan:
    slots: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] each row's own blocks (padded with block 0, masked out)
    lens: torch.Tensor  # [B] int64 tokens of each row's own blocks
    block_size: int
    shared: torch.Tensor | None = None  # [P] blocks every row starts with (cascade), else None
    shared_run: int | None = None  # first block when ``shared`` is one run of consecutive blocks (a view)
    bool_mask: torch.Tensor | None = None  # :meth:`mask`, made on first use (the compiled kernel reads lens)
    additive: torch.Tensor | None = None  # ``mask`` as 0 / -inf in the query dtype (cascade; made once)
    buffers: GatherBuffers | None = None  # reused gathers (CUDA), else None

    def mask(self) -> torch.Tensor:
        """``[B, 1, 1, max_blocks * block_size]`` bool: which padded key positions each row attends."""
        if self.bool_mask is None:
            span = torch.arange(self.block_tables.shape[1] * self.block_size, device=self.lens.device)
            self.bool_mask = (span[None, :] < self.lens[:, None])[:, None, None, :]
        return self.bool_mask

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        if self.additive is None:
            mask = self.mask()
            self.additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        return self.additive


def _gather(cache: torch.Tensor, blocks: torch.Tensor, buffers: GatherBuffers | None = None,
            key: object = None) -> torch.Tensor:
    """Tokens of ``blocks`` ([N] or [B, N]) as ``[N * block_size, ...]`` or ``[B, N * block_size, ...]``,
    into ``buffers`` under ``key`` when given.

    ``index_select`` on the flat block axis: on CPU it is ~10x faster than advanced indexing."""
    if buffers is not None:
        return buffers.gather(key, cache, blocks)
    out = cache.index_select(0, blocks.reshape(-1))
    return out.view(*blocks.shape[:-1], -1, *cache.shape[2:])


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``; fp16 to bf16 through fp32, the same values: PyTorch's CPU cast between the two 16-bit types
    runs at about half the speed of the two vectorised casts (on AMX, the casts of an fp16 cache's gathered keys and
    values for bf16 attention: 6.0 ms of a 32.5 ms resume step, 3.9 ms this way; the compiled gather of
    :mod:`.cpu_gather`, where it builds, does gather and casts in one pass instead)."""
    if t.dtype == torch.float16 and dtype == torch.bfloat16:
        return t.float().to(dtype)
    return t.to(dtype)


def _run_start(blocks: list[int]) -> int | None:
    """The first block when ``blocks`` are consecutive ids (their K/V are one slice of the cache), else None.

    The agents' shared prefix usually is: it is the first thing written into a fresh cache."""
    first = blocks[0]
    return first if blocks == list(range(first, first + len(blocks))) else None


@functools.lru_cache(maxsize=16)  # a step's chunks need a few; up to ~1.5 MB each (8 query heads a KV head)
def _causal_block(group: int, rows: int, keys: int, offset: int, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """The additive causal mask of a block of ``rows`` queries against ``keys`` keys that start ``offset`` positions
    before the block's first row, for each of a KV head's ``group`` query heads folded into rows:
    ``[1, 1, group * rows, keys]``, 0 where row ``j`` attends key ``c <= offset + j``, -inf after.  The same for every
    layer of a step, so made once."""
    mask = torch.full((group, rows, keys), float("-inf"), dtype=dtype, device=device).triu_(offset + 1)
    return mask.view(1, 1, group * rows, keys)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _rows_padded(qh: torch.Tensor, rows: int) -> torch.Tensor:
    """Query rows ``[kv_heads, group, r, D]`` as ``[1, kv_heads, group * rows, D]``, zero rows appended
    (``rows >= r``)."""
    kvh, g, r, d = qh.shape
    if rows == r:
        return qh.reshape(1, kvh, g * r, d)
    padded = qh.new_zeros(kvh, g, rows, d)
    padded[:, :, :r] = qh
    return padded.view(1, kvh, g * rows, d)


def _keys_padded(kh: torch.Tensor, begin: int, end: int, keys: int) -> torch.Tensor:
    """Keys (or values) ``[begin, end)`` of ``kh`` ``[1, kv_heads, S, D]``, zeros appended up to ``keys`` of them."""
    if keys == end - begin:
        return kh[:, :, begin:end]
    padded = kh.new_zeros(1, kh.shape[1], keys, kh.shape[3])
    padded[:, :, : end - begin] = kh[:, :, begin:end]
    return padded


def _flash_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
               scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU flash attention returning ``(out, lse)``: SDPA's CPU kernel, which also keeps the log-sum-exp.

    ``attn_mask`` must be additive and of the query's dtype."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=attn_mask, scale=scale)


class TorchAttention(AttentionBackend):
    """Reference backend. GQA runs without repeating K/V: each KV head's query group is folded into rows."""

    def __init__(self, *args, sdpa_prefill: bool | None = None, cascade_decode: bool | None = None,
                 reuse_gathers: bool | None = None, decode_kernel: PagedDecodeKernel | None = None,
                 prefill_kernel: PagedPrefillKernel | None = None, prefill_dtype: torch.dtype | None = None,
                 bf16_gather: Bf16Gather | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.group = self.num_heads // self.num_kv_heads
        self.sdpa_prefill = self.device.type == "cuda" if sdpa_prefill is None else sdpa_prefill
        self.reuse_gathers = self.device.type == "cuda" if reuse_gathers is None else reuse_gathers
        self.decode_kernel = decode_kernel  # fp32 CPU caches only: the caller checks
        self.prefill_kernel = prefill_kernel  # fp32 CPU queries, chunks of more than one token: the caller checks
        self.prefill_dtype = prefill_dtype  # PyTorch attends prefill chunks on copies in this dtype (None: as q)
        self.bf16_gather = bf16_gather  # gathers an fp16 cache's blocks as bf16 in one pass (CPU), else None
        # cascade needs the log-sum-exp of each partial attention: CPU's flash kernel returns it
        self.cascade_decode = self.device.type == "cpu" if cascade_decode is None else cascade_decode
        self.cascade_decode &= decode_kernel is None  # the kernel walks a batch's shared prefix once itself

    def plan(self, batch: AttentionBatch) -> _PrefillPlan | _DecodePlan:
        slots = batch.slot_mapping.to(self.device, non_blocking=True)
        if batch.is_decode:
            return self._plan_decode(batch, slots)
        chunks, begin, decodes = [], 0, []
        for i, (qlen, start, table) in enumerate(
            zip(batch.query_lens, batch.start_pos, batch.block_tables, strict=True)
        ):
            if qlen == 1 and start > 0:  # a decode riding in a mixed step
                decodes.append((i, begin))
            else:
                blocks, kernel = None, self.prefill_kernel is not None and qlen > 1
                if start > 0 or kernel:
                    n = -(-(start + qlen) // self.block_size)
                    blocks = torch.tensor(table[:n], dtype=torch.int64).to(self.device, non_blocking=True)
                chunks.append(_Chunk(begin, begin + qlen, start, blocks, kernel))
            begin += qlen
        plan = _PrefillPlan(slots, chunks, buffers=GatherBuffers() if self.reuse_gathers else None)
        if decodes:
            idx = [i for i, _ in decodes]
            sub = AttentionBatch(True, [1] * len(idx), [batch.start_pos[i] for i in idx],
                                 [batch.block_tables[i] for i in idx], batch.slot_mapping[idx])
            rows = torch.tensor([row for _, row in decodes], dtype=torch.int64)
            plan.decode_rows = rows.to(self.device, non_blocking=True)
            plan.decode = self._plan_decode(sub, slots[plan.decode_rows])
        return plan

    def _plan_decode(self, batch: AttentionBatch, slots: torch.Tensor) -> _DecodePlan:
        bs, seq_lens = self.block_size, batch.seq_lens
        rows = [t[: -(-n // bs)] for t, n in zip(batch.block_tables, seq_lens, strict=True)]
        n_shared = cascade.shared_blocks(rows, seq_lens, bs) if self.cascade_decode else 0
        if n_shared * bs < cascade.MIN_SHARED_TOKENS:
            n_shared = 0
        shared = run = None
        if n_shared:
            shared = torch.tensor(rows[0][:n_shared], dtype=torch.int64).to(self.device, non_blocking=True)
            run = _run_start(rows[0][:n_shared])
            rows = [r[n_shared:] for r in rows]
            seq_lens = [n - n_shared * bs for n in seq_lens]
        width = max(len(r) for r in rows)
        padded = [r + [0] * (width - len(r)) for r in rows]
        tables = torch.tensor(padded, dtype=torch.int64).to(self.device, non_blocking=True)
        lens = torch.tensor(seq_lens, dtype=torch.int64).to(self.device, non_blocking=True)
        buffers = GatherBuffers() if self.reuse_gathers else None
        return _DecodePlan(slots, tables, lens, bs, shared, run, buffers=buffers)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: _PrefillPlan | _DecodePlan) -> torch.Tensor:
        narrow = k_cache.dtype != q.dtype  # an fp16 cache under fp32 activations (CPU)
        if narrow:  # a chunk attends its own new keys as stored, as a later chunk will read them
            k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slots, k)
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slots, v)
        if isinstance(meta, _DecodePlan):
            return self._decode(q, k_cache, v_cache, meta)
        out = torch.empty_like(q, dtype=self._prefill_out_dtype(q, meta))
        # the lane's thread count now, not the plan's: between two layers the core loan may narrow or widen it
        threads = torch.get_num_threads()
        for i, c in enumerate(meta.chunks):
            if c.kernel:
                out[c.begin : c.end] = self.prefill_kernel.run(q[c.begin : c.end].contiguous(), k_cache, v_cache,
                                                               c.blocks, c.start, self.scale, threads)
                continue
            ck, cv, qc = k[c.begin : c.end], v[c.begin : c.end], q[c.begin : c.end]
            dtype = self.prefill_dtype or q.dtype
            if c.blocks is not None:
                n = c.end - c.begin + c.start
                ck = self._cached(k_cache, c.blocks, n, dtype, meta.buffers, ("k", i), threads)
                cv = self._cached(v_cache, c.blocks, n, dtype, meta.buffers, ("v", i), threads)
            if ck.dtype != dtype:  # an fp16 cache widened, or copies for bf16 attention
                ck, cv = _cast(ck, dtype), _cast(cv, dtype)
            qc = qc.to(dtype)
            attend = self._sdpa_chunk if self.sdpa_prefill else self._flash_chunk
            out[c.begin : c.end] = attend(qc, ck, cv, c.start)  # into out's dtype
        if meta.decode is not None:
            rows = meta.decode_rows
            out[rows] = self._decode(q[rows], k_cache, v_cache, meta.decode).view(len(rows), *q.shape[1:])
        return out.view(q.shape[0], -1)

    def _cached(self, cache: torch.Tensor, blocks: torch.Tensor, n: int, dtype: torch.dtype,
                buffers: GatherBuffers | None, key: object, threads: int) -> torch.Tensor:
        """A chunk's sequence's first ``n`` cached tokens: in one pass as bf16 where they are wanted so from an fp16
        cache and the compiled gather is there (the same bits as gathering, then casting), else as stored."""
        if self.bf16_gather is not None and dtype == torch.bfloat16 and cache.dtype == torch.float16:
            return self.bf16_gather(cache, blocks, n, threads)
        return _gather(cache, blocks, buffers, key)[:n]

    def _prefill_out_dtype(self, q: torch.Tensor, meta: _PrefillPlan) -> torch.dtype:
        """q's dtype; bf16 where every chunk is attended on bf16 copies in a forward that multiplies every row in
        bf16 (:func:`.linear.bf16_forward`): the o-projection rounds the result to bf16 anyway, and neither a widened
        copy nor its rounding again is made."""
        if self.prefill_query_dtype(meta) != torch.bfloat16:
            return q.dtype
        return torch.bfloat16 if bf16_forward() else q.dtype

    def prefill_query_dtype(self, meta: _PrefillPlan | _DecodePlan) -> torch.dtype | None:
        """For a CPU prefill plan without decode rows: ``prefill_dtype`` where PyTorch attends every chunk; fp32 where
        the compiled prefill kernel takes some (it reads fp32 queries; the others, of one token, attend as given)."""
        if not isinstance(meta, _PrefillPlan) or self.sdpa_prefill or meta.decode is not None:
            return None
        if any(c.kernel for c in meta.chunks):
            return torch.float32 if self.prefill_dtype is None else None
        return self.prefill_dtype

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: _DecodePlan) -> torch.Tensor:
        b = q.shape[0]
        if self.decode_kernel is not None:
            out = self.decode_kernel.run(q.contiguous(), k_cache, v_cache, meta.block_tables, meta.lens, self.scale,
                                         torch.get_num_threads())  # now: a riding decode's layer may run narrowed
            return out.view(b, -1)
        kc = _gather(k_cache, meta.block_tables, meta.buffers, "k").to(q.dtype).transpose(1, 2)  # [B, kv_heads, S, D]
        vc = _gather(v_cache, meta.block_tables, meta.buffers, "v").to(q.dtype).transpose(1, 2)
        qg = q.view(b, self.num_kv_heads, self.group, self.head_dim)
        if meta.shared is None:
            out = F.scaled_dot_product_attention(qg, kc, vc, attn_mask=meta.mask(), scale=self.scale)
            return out.reshape(b, -1)
        own, own_lse = _flash_cpu(qg, kc, vc, attn_mask=meta.additive_mask(q.dtype), scale=self.scale)
        shared, shared_lse = self._decode_shared(qg, k_cache, v_cache, meta.shared, meta.shared_run)
        return cascade.merge(shared, shared_lse, own, own_lse).reshape(b, -1)

    def _decode_shared(self, qg: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       blocks: torch.Tensor, run: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every query of the batch against the shared blocks in one call: the batch's rows become query
        rows of each KV head.  Returns output ``[B, kv_heads, group, D]`` and its lse ``[B, kv_heads, group]``.

        ``run``: the blocks are consecutive from ``run`` — their K/V are read in place, not gathered."""
        b, kvh, g, d = qg.shape
        if run is None:
            ks, vs = _gather(k_cache, blocks), _gather(v_cache, blocks)
        else:
            n = blocks.numel()
            ks, vs = (c.narrow(0, run, n).view(-1, *c.shape[2:]) for c in (k_cache, v_cache))
        ks, vs = (t.to(qg.dtype).transpose(0, 1).unsqueeze(0) for t in (ks, vs))  # [1, kv_heads, P, D]
        rows = qg.transpose(0, 1).reshape(1, kvh, b * g, d)
        out, lse = _flash_cpu(rows, ks, vs, scale=self.scale)
        return out.view(kvh, b, g, d).transpose(0, 1), lse.view(kvh, b, g).transpose(0, 1)

    def _sdpa_chunk(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        """q [L, heads, D] against k/v [start + L, kv_heads, D]; returns [L, heads, D].

        4-D with ``enable_gqa`` so SDPA's fused kernels take it; causal aligned to the last key."""
        n, s = q.shape[0], k.shape[0]
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads | kv_heads, L | S, D]
        mask = causal_lower_right(n, s) if start > 0 else None
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=mask is None, scale=self.scale,
                                             enable_gqa=self.group > 1)
        return out[0].transpose(0, 1)

    def _flash_chunk(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        """CPU prefill in query blocks, GQA groups folded into rows. Shapes as ``_sdpa_chunk``.

        Each block of rows attends the keys before its first row (the cached prefix and the chunk's earlier rows)
        without a mask, and the rest — its own rows' keys — under a causal mask, the two merged by log-sum-exp
        (:func:`cascade.merge`): no mask is built, filled or added over the bulk of the keys.  In bf16 every call has
        a bounded set of shapes: PyTorch keeps the kernels it generates for each shape it meets, for the life of the
        process (~75 KB each on an AMX Xeon), so a block's rows are padded to :data:`ROW_PAD` with zero rows and the
        unmasked call takes a multiple of :data:`KEY_PAD` keys, the masked one the remainder padded to that multiple
        with masked zero keys."""
        n, kvh, g, d = q.shape[0], self.num_kv_heads, self.group, self.head_dim
        row_pad, key_pad = (ROW_PAD, KEY_PAD) if q.dtype == torch.bfloat16 else (1, 1)
        qh = q.view(n, kvh, g, d).permute(1, 2, 0, 3)  # [kv_heads, group, n, D]
        kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, S, D] views
        out = torch.empty(n, kvh, g, d, dtype=q.dtype, device=q.device)
        for r0 in range(0, n, CPU_ROW_BLOCK):
            r1 = min(n, r0 + CPU_ROW_BLOCK)
            rows, seen, own = _round_up(r1 - r0, row_pad), start + r0, start + r1
            split = seen - seen % key_pad  # keys [0, split) precede every row of the block, [split, own) go masked
            keys = _round_up(own - split, key_pad)
            qb = _rows_padded(qh[:, :, r0:r1], rows)
            mask = _causal_block(g, rows, keys, seen - split, q.dtype, q.device)
            ob, lse = _flash_cpu(qb, _keys_padded(kh, split, own, keys), _keys_padded(vh, split, own, keys),
                                 attn_mask=mask, scale=self.scale)
            if split > 0:
                op, lp = _flash_cpu(qb, kh[:, :, :split], vh[:, :, :split], scale=self.scale)
                ob = cascade.merge(op, lp, ob, lse)
            out[r0:r1] = ob.view(kvh, g, rows, d)[:, :, : r1 - r0].permute(2, 0, 1, 3)
        return out.view(n, self.num_heads, d)
