"""Decode CUDA graphs: capture the decode forward pass per (rung, bucket), replay it from static buffers.

What a graph reads is fixed at capture: the static input buffers (token ids, positions, KV slots, sequence
lengths and block tables, all int32, shared by every graph), the weights and the KV cache; what it writes
is its own logits tensor, in one memory pool shared by every graph of every rung.  A replay copies the
step's padded rows (:func:`graphs.pad_decode_rows`) from pinned host staging into the static buffers with
two copies, then launches the graph on the current stream.  Only the Triton attention backend is captured:
its decode plan is plain tensors and its kernels write nothing for padding rows.

Capturing is injectable (``capture=``): on CUDA :func:`cuda_capture`; tests on a CPU use :func:`eager_capture`,
which re-runs the function into the same output, to check the static-buffer plumbing against eager decode.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from agentserve.executor.attention.triton_backend import TritonAttention, TritonDecodePlan, choose_num_splits
from agentserve.executor.graphs import GraphKey, GraphTable, batch_buckets, capture_order, pad_decode_rows
from agentserve.executor.kv_cache import KVCache
from agentserve.executor.model import DecoderModel

log = logging.getLogger(__name__)
Replay = Callable[[], None]
Capture = Callable[[Callable[[], torch.Tensor], Any, Any], tuple[Replay, torch.Tensor]]


def cuda_capture(fn: Callable[[], torch.Tensor], pool: Any, stream: Any) -> tuple[Replay, torch.Tensor]:
    """Run ``fn`` once (kernels compile, the allocator settles), then capture it on ``stream`` into ``pool``.

    ``thread_local`` capture: the other lane's thread may keep launching work meanwhile.  The legacy default
    stream cannot capture: a side stream of the same (whole-device) context does it instead."""
    if stream == torch.cuda.default_stream(stream.device):
        side = torch.cuda.Stream(stream.device)
        side.wait_stream(stream)
        stream = side
    with torch.cuda.stream(stream):
        fn()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        out = fn()
    return graph.replay, out


def eager_capture(fn: Callable[[], torch.Tensor], pool: Any, stream: Any) -> tuple[Replay, torch.Tensor]:
    """A stand-in for a graph: each replay runs ``fn`` again and writes its result into the same tensor."""
    out = fn()
    return (lambda: out.copy_(fn())), out


@dataclass
class _Captured:
    replay: Replay
    logits: torch.Tensor  # [bucket, vocab] fp32, rewritten by every replay


class DecodeGraphs:
    """Decode graphs of one model: :meth:`capture_rung` per rung, :meth:`replay` per step, :meth:`clear`."""

    def __init__(self, model: DecoderModel, kv_cache: KVCache, attention: TritonAttention, max_model_len: int,
                 max_batch: int | None = None, capture: Capture | None = None) -> None:
        self.model, self.kv_cache, self.attention = model, kv_cache, attention
        self.device, self.block_size = attention.device, attention.block_size
        self.max_model_len = max_model_len
        self.buckets = batch_buckets(max_batch) if max_batch else batch_buckets()
        self.table: GraphTable[_Captured] = GraphTable(self.buckets)
        cuda = self.device.type == "cuda"
        self.capture = capture or (cuda_capture if cuda else eager_capture)
        self.pool = torch.cuda.graph_pool_handle() if cuda else None
        rows, width = self.buckets[-1], -(-max_model_len // self.block_size)
        self._vec = torch.zeros(4, rows, dtype=torch.int32, device=self.device)  # ids, positions, slots, lens
        self._tables = torch.zeros(rows, width, dtype=torch.int32, device=self.device)
        self._host_vec = torch.zeros(4, rows, dtype=torch.int32, pin_memory=cuda)
        self._host_tables = torch.zeros(rows, width, dtype=torch.int32, pin_memory=cuda)

    def _forward(self, bucket: int, num_splits: int) -> torch.Tensor:
        ids, positions, slots, lens = self._vec[:, :bucket]
        plan = TritonDecodePlan(slots, self._tables[:bucket], lens, num_splits)
        hidden = self.model.forward(ids, positions, self.kv_cache, self.attention, plan)
        return self.model.logits(hidden)

    def capture_rung(self, rung: int, sm_count: int, stream: Any = None,
                     progress: Callable[[GraphKey], None] | None = None) -> int:
        """Capture every bucket of ``rung`` on ``stream`` (default: the current one); split-K sized for
        ``sm_count`` SMs (the rung's decode share).  Returns how many graphs were captured."""
        if stream is None and self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
        a = self.attention
        for key in capture_order([rung], self.buckets):
            splits = choose_num_splits(key.bucket, a.num_kv_heads, self.max_model_len, sm_count,
                                       a.min_split_tokens, a.max_splits)
            self._vec[:, : key.bucket] = 0  # capture with padding rows: nothing read, nothing written
            self._vec[2, : key.bucket] = -1
            replay, logits = self.capture(lambda b=key.bucket, s=splits: self._forward(b, s), self.pool, stream)
            self.table.add(key, _Captured(replay, logits))
            if progress is not None:
                progress(key)
        return len(self.buckets)

    def replay(self, rung: int, token_ids: list[int], positions: list[int],
               tables: list[list[int]]) -> torch.Tensor | None:
        """fp32 logits ``[n, vocab]`` of one decode step from ``rung``'s graph, or None (no graph fits: run
        it eagerly).  The result is a view the next replay overwrites."""
        found = self.table.lookup(rung, len(token_ids))
        if found is None:
            return None
        key, captured = found
        rows = pad_decode_rows(token_ids, positions, tables, self.block_size, key.bucket)
        n, width = rows.n, len(rows.tables[0])
        if width > self._tables.shape[1]:
            return None
        host_vec = self._host_vec[:, : key.bucket]
        host_vec.copy_(torch.tensor([rows.token_ids, rows.positions, rows.slots, rows.seq_lens], dtype=torch.int32))
        host_tables = self._host_tables[:n, :width]
        host_tables.copy_(torch.tensor(rows.tables, dtype=torch.int32))
        self._vec[:, : key.bucket].copy_(host_vec, non_blocking=True)
        self._tables[:n, :width].copy_(host_tables, non_blocking=True)
        captured.replay()
        return captured.logits[:n]

    def drop_rung(self, rung: int) -> None:
        self.table.drop_rung(rung)

    def clear(self) -> None:
        """Forget every graph (before the partitions they were captured on are destroyed)."""
        self.table.clear()
