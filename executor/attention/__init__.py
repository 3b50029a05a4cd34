"""Attention backends behind one narrow interface (:class:`AttentionBackend`).

``auto``: PyTorch attention, with the compiled paged-decode kernel for fp32 decode on a CPU where it builds
(:mod:`.cpu_kernel`). ``torch``: PyTorch only (the reference). ``cpu-kernel``: as ``auto``, but an error
where the kernel cannot be used.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from agentserve.executor.attention.base import AttentionBackend, AttentionBatch
from agentserve.executor.errors import EngineError

if TYPE_CHECKING:
    from agentserve.executor.attention.cpu_kernel import PagedDecodeKernel

BACKENDS = ("auto", "torch", "cpu-kernel")
log = logging.getLogger(__name__)


def create_backend(
    name: str, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, device: torch.device,
    dtype: torch.dtype,
) -> AttentionBackend:
    """Instantiate the attention backend called ``name`` for a KV cache of ``dtype`` on ``device``."""
    if name not in BACKENDS:
        raise EngineError(f"unknown attention backend {name!r}; available: {', '.join(BACKENDS)}")
    from agentserve.executor.attention.torch_backend import TorchAttention

    kernel = None if name == "torch" else _decode_kernel(name, num_heads, num_kv_heads, head_dim, block_size,
                                                          device, dtype)
    return TorchAttention(num_heads, num_kv_heads, head_dim, block_size, device, decode_kernel=kernel)


def _decode_kernel(name: str, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                   device: torch.device, dtype: torch.dtype) -> PagedDecodeKernel | None:
    """The compiled CPU decode kernel where it applies; else None (``auto``, logged) or an error (``cpu-kernel``)."""
    from agentserve.executor.attention import cpu_kernel

    kernel, why = None, "it needs a float32 model on the CPU"
    if device.type == "cpu" and dtype == torch.float32:
        if (kernel := cpu_kernel.load()) is None:
            why = "it could not be built (see the log)"
        elif not kernel.supports(num_heads, num_kv_heads, head_dim, block_size):
            kernel, why = None, (f"{num_heads} heads / {num_kv_heads} KV heads of size {head_dim} in blocks of "
                                 f"{block_size} are beyond its limits")
    if name == "cpu-kernel" and kernel is None:
        raise EngineError(f"attention backend 'cpu-kernel' is unavailable: {why}")
    if device.type == "cpu":
        log.info("decode attention: %s", "the compiled paged-decode kernel" if kernel else f"PyTorch ({why})")
    return kernel


__all__ = ["AttentionBackend", "AttentionBatch", "create_backend", "BACKENDS"]
