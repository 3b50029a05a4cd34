"""Attention backends behind one narrow interface (:class:`AttentionBackend`).

``auto``: on a CPU, PyTorch attention with the compiled paged-decode kernel for fp32 decode where it builds
(:mod:`.cpu_kernel`); on CUDA, FlashInfer where it is installed, else the Triton kernels, else PyTorch.
``torch``: PyTorch only (the reference). ``cpu-kernel``: as ``auto`` on a CPU, but an error where the kernel
cannot be used. ``triton`` (:mod:`.triton_backend`) and ``flashinfer`` (:mod:`.flashinfer_backend`): those
paged kernels, or an error saying why they cannot run here.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING

import torch

from agentserve.executor.attention.base import AttentionBackend, AttentionBatch
from agentserve.executor.errors import EngineError

if TYPE_CHECKING:
    from agentserve.executor.attention.cpu_kernel import PagedDecodeKernel

BACKENDS = ("auto", "torch", "cpu-kernel", "triton", "flashinfer")
log = logging.getLogger(__name__)


def create_backend(
    name: str, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, device: torch.device,
    dtype: torch.dtype, cache_dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """Instantiate the attention backend called ``name`` for ``dtype`` activations on ``device`` over a KV cache
    of ``cache_dtype`` (default: ``dtype``; PyTorch and the compiled CPU kernel also take fp16 beside fp32)."""
    cache_dtype = dtype if cache_dtype is None else cache_dtype
    if cache_dtype != dtype and (device.type != "cpu" or name in ("triton", "flashinfer")):
        raise EngineError(f"attention backend {name!r} on {device.type} needs the KV cache in the model dtype")
    if name not in BACKENDS:
        raise EngineError(f"unknown attention backend {name!r}; available: {', '.join(BACKENDS)}")
    if name == "auto" and device.type == "cuda":
        name = cuda_default()
        log.info("attention backend on CUDA: %s", name)
    shape = (num_heads, num_kv_heads, head_dim, block_size, device)
    if name == "triton":
        _require_triton(device)
        from agentserve.executor.attention.triton_backend import TritonAttention

        return TritonAttention(*shape)
    if name == "flashinfer":
        from agentserve.executor.attention.flashinfer_backend import FlashInferAttention

        return FlashInferAttention(*shape, dtype=dtype)
    from agentserve.executor.attention.torch_backend import TorchAttention

    kernel = None if name == "torch" else _decode_kernel(name, num_heads, num_kv_heads, head_dim, block_size,
                                                          device, dtype, cache_dtype)
    return TorchAttention(num_heads, num_kv_heads, head_dim, block_size, device, decode_kernel=kernel)


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def cuda_default() -> str:
    """``auto`` on CUDA: FlashInfer where installed, else Triton (it ships with CUDA PyTorch), else PyTorch."""
    if installed("flashinfer"):
        return "flashinfer"
    return "triton" if installed("triton") else "torch"


def _require_triton(device: torch.device) -> None:
    from agentserve.executor.attention.triton_backend import interpreting

    if not installed("triton"):
        raise EngineError("attention backend 'triton' needs the triton package (it ships with CUDA PyTorch)")
    if device.type != "cuda" and not interpreting():
        raise EngineError("attention backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1 before start-up "
                          "to run its kernels in Triton's CPU interpreter, slowly, for tests)")


def cpu_decode_kernel(name: str, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                      device: torch.device, dtype: torch.dtype) -> tuple[PagedDecodeKernel | None, str]:
    """The compiled CPU decode kernel that backend ``name`` runs for this model, or None and why not."""
    if name not in ("auto", "cpu-kernel"):
        return None, f"attention backend {name!r}"
    if device.type != "cpu" or dtype != torch.float32:
        return None, "it needs a float32 model on the CPU"
    from agentserve.executor.attention import cpu_kernel

    if (kernel := cpu_kernel.load()) is None:
        return None, "it could not be built (see the log)"
    if not kernel.supports(num_heads, num_kv_heads, head_dim, block_size):
        return None, (f"{num_heads} heads / {num_kv_heads} KV heads of size {head_dim} in blocks of {block_size} "
                      "are beyond its limits")
    return kernel, ""


def _decode_kernel(name: str, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                   device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype) -> PagedDecodeKernel | None:
    """The compiled CPU decode kernel where it applies; else None (``auto``, logged) or an error (``cpu-kernel``)."""
    kernel, why = cpu_decode_kernel(name, num_heads, num_kv_heads, head_dim, block_size, device, dtype)
    if kernel is not None and cache_dtype not in kernel.cache_dtypes:
        kernel, why = None, f"this build does not read a {str(cache_dtype).removeprefix('torch.')} cache"
    if name == "cpu-kernel" and kernel is None:
        raise EngineError(f"attention backend 'cpu-kernel' is unavailable: {why}")
    if device.type == "cpu":
        log.info("decode attention: %s", f"the compiled paged-decode kernel over a {cache_dtype} cache" if kernel
                 else f"PyTorch ({why})")
    return kernel


__all__ = ["AttentionBackend", "AttentionBatch", "create_backend", "cpu_decode_kernel", "BACKENDS"]
