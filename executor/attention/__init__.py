"""Attention backends behind one narrow interface (:class:`AttentionBackend`).

``auto``: on a CPU, PyTorch attention with the compiled paged-decode kernel for fp32 decode where it builds
(:mod:`.cpu_kernel`); on CUDA, FlashInfer where it is installed, else the Triton kernels, else PyTorch.
``torch``: PyTorch only (the reference). ``cpu-kernel``: as ``auto`` on a CPU, but an error where the kernel
cannot be used.  Prefill attention on a CPU (``prefill_attention``, :func:`cpu_prefill_kernel`): ``auto`` runs
PyTorch's flash attention on bf16 copies where the CPU has AMX tiles and the model's matrices already multiply
prefill rows in bf16 (hybrid), else the compiled bf16 kernel (:mod:`.cpu_prefill`) where the CPU has AVX512-BF16
and the rows are bf16, else the compiled fp32 kernel on CPUs without AVX-512, else PyTorch's fp32 flash attention;
``bf16`` and ``fp32`` those kernels wherever they run, ``torch`` PyTorch, ``torch-bf16`` PyTorch on bf16 copies.
``triton`` (:mod:`.triton_backend`) and ``flashinfer`` (:mod:`.flashinfer_backend`): those paged kernels, or an
error saying why they cannot run here.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

from agentserve.executor.attention.base import AttentionBackend, AttentionBatch
from agentserve.executor.errors import EngineError
from agentserve.executor.linear import cpu_has_amx

if TYPE_CHECKING:
    from agentserve.executor.attention.cpu_kernel import PagedDecodeKernel
    from agentserve.executor.attention.cpu_prefill import PagedPrefillKernel

BACKENDS = ("auto", "torch", "cpu-kernel", "triton", "flashinfer")


class _Kernel(Protocol):
    def supports(self, heads: int, kv_heads: int, dim: int, block_size: int) -> bool: ...


K = TypeVar("K", bound=_Kernel)
PREFILL_ATTENTION = ("auto", "bf16", "fp32", "torch", "torch-bf16")
log = logging.getLogger(__name__)


def create_backend(
    name: str, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, device: torch.device,
    dtype: torch.dtype, cache_dtype: torch.dtype | None = None, prefill: str = "auto", bf16_rows: bool = False,
) -> AttentionBackend:
    """Instantiate the attention backend called ``name`` for ``dtype`` activations on ``device`` over a KV cache
    of ``cache_dtype`` (default: ``dtype``; PyTorch and the compiled CPU kernel also take fp16 beside fp32).

    ``prefill``: the ``prefill_attention`` setting; ``bf16_rows``: the model's matrices multiply prefill rows in
    bf16 (what ``auto`` asks before it attends them in bf16 too)."""
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
    prefill_kernel, why = cpu_prefill_kernel(prefill, name, num_heads, num_kv_heads, head_dim, block_size, device,
                                             dtype, bf16_rows)
    prefill_dtype = torch_prefill_dtype(prefill, device, dtype, bf16_rows)
    if device.type == "cpu":
        log.info("prefill attention: %s", f"the compiled {prefill_kernel.variant} kernel" if prefill_kernel
                 else f"PyTorch {'bf16' if prefill_dtype == torch.bfloat16 else 'fp32'} ({why})")
    gather = None
    if device.type == "cpu" and prefill_dtype == torch.bfloat16 and cache_dtype == torch.float16:
        from agentserve.executor.attention import cpu_gather

        gather = cpu_gather.load()
    return TorchAttention(num_heads, num_kv_heads, head_dim, block_size, device, decode_kernel=kernel,
                          prefill_kernel=prefill_kernel, prefill_dtype=prefill_dtype, bf16_gather=gather)


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
    from agentserve.executor.attention import cpu_kernel

    return _compiled(cpu_kernel.load, "it could not be built (see the log)", name,
                     (num_heads, num_kv_heads, head_dim, block_size), device, dtype)


def cpu_prefill_kernel(setting: str, name: str, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                       device: torch.device, dtype: torch.dtype,
                       bf16_rows: bool) -> tuple[PagedPrefillKernel | None, str]:
    """The compiled prefill kernel under ``prefill_attention = setting`` with attention backend ``name``, or None and
    why not.  ``auto``: PyTorch on bf16 copies where :func:`torch_prefill_dtype` says so (AMX), else the bf16 kernel
    where prefill rows already multiply in bf16 (hybrid matrices), else the fp32 kernel where it is the faster fp32
    path (:func:`cpu_prefill.preferred`), else PyTorch.  ``bf16`` or ``fp32`` where that kernel cannot run raises
    :class:`EngineError`."""
    from agentserve.executor.attention import cpu_prefill

    if setting in ("torch", "torch-bf16") or torch_prefill_dtype(setting, device, dtype, bf16_rows):
        return None, ("AMX tiles: PyTorch's bf16 flash attention runs on them" if setting == "auto"
                      else f"prefill_attention {setting}")
    shape = (num_heads, num_kv_heads, head_dim, block_size)
    if setting != "auto":
        kernel, why = _prefill_variant(setting, name, shape, device, dtype)
        if kernel is None:
            raise EngineError(f"prefill_attention {setting!r} is unavailable: {why}")
        return kernel, ""
    why = "the matrices multiply prefill rows in fp32"
    if bf16_rows:
        kernel, why = _prefill_variant("bf16", name, shape, device, dtype)
        if kernel is not None:
            return kernel, ""
    # the fp32 kernel only where it is the faster fp32 path; _compiled asks nothing of the library where no kernel runs
    return _compiled(lambda: cpu_prefill.load("fp32") if cpu_prefill.preferred() else None,
                     f"{why}; PyTorch's flash attention is the fp32 path with AVX-512 and where the fp32 kernel is "
                     "unavailable", name, shape, device, dtype)


def torch_prefill_dtype(setting: str, device: torch.device, dtype: torch.dtype, bf16_rows: bool) -> torch.dtype | None:
    """bf16 where PyTorch attends prefill chunks on bf16 copies of their queries, keys and values (fp32 results):
    ``torch-bf16``, and ``auto`` where the CPU has AMX tiles and prefill rows already multiply in bf16 — PyTorch's
    bf16 flash attention runs on the tiles there (on an AMX Xeon this engine prefilled 4,096 tokens 1.8x as fast as
    with the compiled bf16 kernel, docs/benchmarks.md); else None (the model's dtype).  ``torch-bf16`` off a
    float32 CPU model raises :class:`EngineError`."""
    if setting not in PREFILL_ATTENTION:
        raise EngineError(f"unknown prefill_attention {setting!r}; available: {', '.join(PREFILL_ATTENTION)}")
    cpu_fp32 = device.type == "cpu" and dtype == torch.float32
    if setting == "torch-bf16" and not cpu_fp32:
        raise EngineError("prefill_attention 'torch-bf16' is unavailable: it needs a float32 model on the CPU")
    if setting == "torch-bf16" or (setting == "auto" and cpu_fp32 and bf16_rows and cpu_has_amx()):
        return torch.bfloat16
    return None


def _prefill_variant(variant: str, name: str, shape: tuple[int, int, int, int], device: torch.device,
                     dtype: torch.dtype) -> tuple[PagedPrefillKernel | None, str]:
    from agentserve.executor.attention import cpu_prefill

    return _compiled(lambda: cpu_prefill.load(variant), f"no {cpu_prefill.NEEDS[variant]} in this CPU or this "
                     "compiler's build, or the CPU library could not be built (see the log)", name, shape, device,
                     dtype)


def _compiled(load: Callable[[], K | None], unavailable: str, name: str, shape: tuple[int, int, int, int],
              device: torch.device, dtype: torch.dtype) -> tuple[K | None, str]:
    """A compiled CPU kernel (``load``) where backend ``name`` runs it for a float32 model of ``shape`` (heads, KV
    heads, head size, block size) on the CPU, or None and why not."""
    if name not in ("auto", "cpu-kernel"):
        return None, f"attention backend {name!r}"
    if device.type != "cpu" or dtype != torch.float32:
        return None, "it needs a float32 model on the CPU"
    if (kernel := load()) is None:
        return None, unavailable
    if not kernel.supports(*shape):
        heads, kv_heads, dim, block_size = shape
        return None, (f"{heads} heads / {kv_heads} KV heads of size {dim} in blocks of {block_size} are beyond its "
                      "limits")
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


__all__ = ["AttentionBackend", "AttentionBatch", "create_backend", "cpu_decode_kernel", "cpu_prefill_kernel",
           "BACKENDS", "PREFILL_ATTENTION"]
