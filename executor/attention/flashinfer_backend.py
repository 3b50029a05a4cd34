"""Paged attention with FlashInfer (``pip install 'agentserve[cuda]'``), imported only when selected.

``plan`` runs once per forward pass: it builds the paged-KV metadata from our block tables
(:mod:`.flashinfer_meta`) and hands it to one FlashInfer wrapper's ``plan``, which every layer's ``run`` then
reuses.  Decode uses FlashInfer's paged decode, or its two-level cascade when the batch shares at least
``cascade.MIN_SHARED_TOKENS`` of leading blocks; prefill and mixed steps use its paged prefill (causal,
bottom-right aligned after the cached prefix).  Our cache is FlashInfer's ``NHD`` layout already.

FlashInfer wrappers keep the plan they were given, and the two lanes plan concurrently on their own
threads, so each thread gets its own wrappers and workspace.  FlashInfer compiles its kernels with nvcc on
first use: :meth:`FlashInferAttention.warmup` compiles the variants this model needs at start-up.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from agentserve.executor.attention import cascade, flashinfer_meta
from agentserve.executor.attention.base import AttentionBackend, AttentionBatch
from agentserve.executor.errors import EngineError

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-k partial results)


def import_flashinfer() -> Any:
    try:
        import flashinfer
    except ImportError as e:
        raise EngineError("attention backend 'flashinfer' needs FlashInfer: pip install 'agentserve[cuda]' "
                          f"(flashinfer-python) on a CUDA machine ({e})") from e
    return flashinfer


@dataclass
class FlashInferPlan:
    slots: torch.Tensor
    wrapper: Any  # the planned FlashInfer wrapper every layer runs


class _Wrappers:
    """One thread's FlashInfer wrappers over one shared float workspace (a thread plans one at a time)."""

    def __init__(self, fi: Any, device: torch.device, group: int) -> None:
        ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.decode = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=group >= 4)
        self.prefill = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        self.cascade = fi.MultiLevelCascadeAttentionWrapper(2, ws, "NHD")


class FlashInferAttention(AttentionBackend):
    def __init__(self, *args, dtype: torch.dtype, cascade_decode: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.device.type != "cuda":
            raise EngineError("attention backend 'flashinfer' needs a CUDA device")
        self.fi = import_flashinfer()
        self.dtype, self.cascade_decode = dtype, cascade_decode
        self.group = self.num_heads // self.num_kv_heads
        self._local = threading.local()

    def _wrappers(self) -> _Wrappers:
        w = getattr(self._local, "wrappers", None)
        if w is None:
            w = self._local.wrappers = _Wrappers(self.fi, self.device, self.group)
        return w

    def _int32(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32)  # host tensors: FlashInfer's plan reads them there

    def _shape(self) -> tuple[int, int, int, int]:
        return self.num_heads, self.num_kv_heads, self.head_dim, self.block_size

    def _types(self) -> dict[str, Any]:
        return {"sm_scale": self.scale, "q_data_type": self.dtype, "kv_data_type": self.dtype}

    def plan(self, batch: AttentionBatch) -> FlashInferPlan:
        slots = batch.slot_mapping.to(self.device, non_blocking=True)
        w, seq_lens = self._wrappers(), batch.seq_lens
        if batch.is_decode:
            levels = flashinfer_meta.cascade_levels(batch.block_tables, seq_lens, self.block_size,
                                         cascade.MIN_SHARED_TOKENS) if self.cascade_decode else None
            if levels is not None:
                kv = levels.kv
                w.cascade.plan([self._int32(q) for q in levels.qo_indptr], [self._int32(k.indptr) for k in kv],
                               [self._int32(k.indices) for k in kv], [self._int32(k.last_page_len) for k in kv],
                               *self._shape(), **self._types())
                return FlashInferPlan(slots, w.cascade)
            kv = flashinfer_meta.paged_kv(batch.block_tables, seq_lens, self.block_size)
            w.decode.plan(self._int32(kv.indptr), self._int32(kv.indices), self._int32(kv.last_page_len),
                          *self._shape(), pos_encoding_mode="NONE", **self._types())
            return FlashInferPlan(slots, w.decode)
        kv = flashinfer_meta.paged_kv(batch.block_tables, seq_lens, self.block_size)
        w.prefill.plan(self._int32(flashinfer_meta.qo_indptr(batch.query_lens)), self._int32(kv.indptr),
                       self._int32(kv.indices), self._int32(kv.last_page_len), *self._shape(), causal=True,
                       **self._types())
        return FlashInferPlan(slots, w.prefill)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, plan: FlashInferPlan) -> torch.Tensor:
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, plan.slots, k)
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, plan.slots, v)
        out = plan.wrapper.run(q.contiguous(), (k_cache, v_cache))
        return out.reshape(q.shape[0], -1)
