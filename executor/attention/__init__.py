"""Attention backends behind one narrow interface (:class:`AttentionBackend`)."""

from __future__ import annotations

import torch

from agentserve.executor.attention.base import AttentionBackend, AttentionBatch
from agentserve.executor.errors import EngineError

BACKENDS = ("torch",)


def create_backend(
    name: str, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, device: torch.device
) -> AttentionBackend:
    """Instantiate the attention backend called ``name``."""
    if name == "torch":
        from agentserve.executor.attention.torch_backend import TorchAttention

        return TorchAttention(num_heads, num_kv_heads, head_dim, block_size, device)
    raise EngineError(f"unknown attention backend {name!r}; available: {', '.join(BACKENDS)}")


__all__ = ["AttentionBackend", "AttentionBatch", "create_backend", "BACKENDS"]
