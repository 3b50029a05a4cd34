"""The ModelRunner's decode-graph side: whether graphs can run, their memory, capture, replay and release.

Graphs are wanted on CUDA unless ``cuda_graphs="off"``; they are captured only for the Triton attention
backend (:mod:`.graphs_capture`).  The executor captures each rung's set on that rung's decode stream at
start-up and clears them before the partitions are destroyed; a step replays its rung's graph when one fits
and runs eagerly otherwise.
"""

from __future__ import annotations

import logging

import torch

from agentserve.executor.checkpoint import ModelConfig
from agentserve.executor.errors import EngineError
from agentserve.executor.graphs import MAX_GRAPH_BATCH, GraphKey, memory_estimate

log = logging.getLogger(__name__)
GRAPH_MODES = ("auto", "off")


class RunnerGraphs:
    """Mixed into :class:`~agentserve.executor.runner.ModelRunner` (which sets the attributes used here)."""

    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    graphs: object | None = None  # DecodeGraphs once captured
    graph_max_batch: int = MAX_GRAPH_BATCH  # larger decode batches run eagerly

    def _init_graphs(self, mode: str) -> None:
        if mode not in GRAPH_MODES:
            raise EngineError(f"unknown cuda_graphs setting {mode!r}; use {' or '.join(GRAPH_MODES)}")
        self.graphs_wanted = mode != "off" and self.device.type == "cuda"
        self.graphs = None

    def graph_reserve_bytes(self) -> int:
        """Memory the graphs' shared pool may take, kept out of the KV cache's budget (0 without graphs)."""
        if not self.graphs_wanted:
            return 0
        from agentserve.executor.attention.triton_backend import MAX_SPLITS

        c = self.config
        return memory_estimate(max_batch=self.graph_max_batch, hidden=c.hidden_size, intermediate=c.intermediate_size,
                               q_size=c.q_size, kv_size=c.kv_size, vocab=c.vocab_size, num_heads=c.num_heads,
                               head_dim=c.head_dim, dtype_bytes=self.dtype.itemsize, max_splits=MAX_SPLITS)

    def graphs_unavailable(self) -> str | None:
        """Why decode graphs will not be captured here, or None when they will."""
        from agentserve.executor.attention.triton_backend import TritonAttention

        if not self.graphs_wanted:
            return "off" if self.device.type == "cuda" else "not on CUDA"
        if not isinstance(self.attention, TritonAttention):
            return f"the {type(self.attention).__name__} backend is not captured (graphs need 'triton')"
        return None

    @torch.inference_mode()
    def capture_graphs(self, rung: int, sm_count: int) -> int:
        """Capture ``rung``'s decode graphs on the current stream (call it on that rung's decode lane)."""
        from agentserve.executor.graphs_capture import DecodeGraphs

        if self.graphs is None:
            self.graphs = DecodeGraphs(self.model, self.kv_cache, self.attention, self.max_model_len,
                                       self.graph_max_batch)
        done = self.graphs.capture_rung(rung, sm_count, progress=_log_progress)
        log.info("decode graphs: rung %d captured (%d batch sizes, %d graphs in all)", rung, done,
                 len(self.graphs.table))
        return done

    def drop_graphs(self) -> None:
        """Release every graph; call before the partitions (green contexts) they ran on are destroyed."""
        if self.graphs is not None:
            self.graphs.clear()
            self.graphs = None

    def _replay_decode(self, rung: int | None, ids: list[int], positions: list[int],
                       tables: list[list[int]]) -> torch.Tensor | None:
        if self.graphs is None or rung is None:
            return None
        return self.graphs.replay(rung, ids, positions, tables)


def _log_progress(key: GraphKey) -> None:
    log.debug("captured decode graph rung %d batch %d", key.rung, key.bucket)
