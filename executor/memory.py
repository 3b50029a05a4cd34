"""GPU memory: one allocator pool for every lane stream, and the KV cache sized from a profiling step.

**Allocator.**  PyTorch's caching allocator (``native``, the default) keeps the blocks a stream freed for
that stream only; with a stream per (rung, lane) — up to 20 — each keeps its own cache of activations.
``AGENTSERVE_CUDA_ALLOCATOR=shared`` selects the ``cudaMallocAsync`` backend instead: one stream-ordered pool
per device, so memory a lane freed serves the other lanes, and :func:`keep_lanes_independent` tells it not
to make one stream wait on another's frees (``REUSE_ALLOW_INTERNAL_DEPENDENCIES``), which would tie decode to
prefill.  The shared pool cannot hold decode CUDA graphs: on an H200 (torch 2.11, Triton 3.6) Triton refused
the pool's in-capture allocations ("Pointer argument cannot be accessed from Triton"), and the allocation
the aborted capture left behind aborted the process when it was freed — so with it the executor runs decode
eagerly (``cuda_graphs = off``).  The choice is made before torch is imported
(:func:`configure_cuda_allocator`, from ``python -m agentserve.executor``) unless the user set
``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF`` themselves.

**KV budget.**  After the weights are loaded, one prefill chunk and one full decode batch run on a
scratch cache while the allocator records its peak; the KV cache then gets what is left of
``utilization`` × device memory after other holders (the CUDA context, other processes), the weights
and that activation peak (:func:`kv_budget_bytes`).  Attention workspaces that grow with context
length are the attention backend's to bound.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)

SHARED_POOL = "backend:cudaMallocAsync"
ALLOCATOR_ENV = "AGENTSERVE_CUDA_ALLOCATOR"  # native (default) | shared


def configure_cuda_allocator(environ: MutableMapping[str, str] | None = None) -> str:
    """Choose the allocator before torch loads; return ``cudaMallocAsync`` (asked for with ``shared``),
    ``native`` or ``user``.

    Must run before the process imports torch: torch 2.11 reads the backend when it loads, and a value set
    between the import and CUDA's start fails that start with an internal assert.  It sets
    ``PYTORCH_CUDA_ALLOC_CONF``: torch >= 2.9 prefers the name ``PYTORCH_ALLOC_CONF`` but, at least through
    2.11, applies CUDA-only keys only from the old name (pytorch#183387); the cost is a deprecation warning."""
    env = os.environ if environ is None else environ
    choice = env.get(ALLOCATOR_ENV, "native")
    if choice not in ("shared", "native"):
        raise ValueError(f"{ALLOCATOR_ENV}={choice!r}: use shared or native")
    if env.get("PYTORCH_ALLOC_CONF") or env.get("PYTORCH_CUDA_ALLOC_CONF"):
        return "user"
    if choice == "native":
        return "native"
    env["PYTORCH_CUDA_ALLOC_CONF"] = SHARED_POOL
    return "cudaMallocAsync"


def shared_pool_selected(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process's torch allocator is the ``cudaMallocAsync`` pool (ours or the user's setting)."""
    env = os.environ if environ is None else environ
    return any("cudaMallocAsync" in env.get(name, "") for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"))


def keep_lanes_independent(device_index: int) -> str:
    """Turn off the pool's internal cross-stream dependencies; return what was done (for the log)."""
    import torch

    try:
        if torch.cuda.memory.get_allocator_backend() != "cudaMallocAsync":
            return "native caching allocator: one cache per stream"
        from cuda.bindings import driver as drv

        from agentserve.executor.partition.driver import call

        call(drv, "cuInit", 0)
        pool = call(drv, "cuDeviceGetDefaultMemPool", call(drv, "cuDeviceGet", device_index))
        attr = drv.CUmemPool_attribute.CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES
        call(drv, "cuMemPoolSetAttribute", pool, attr, 0)
    except Exception as e:  # noqa: BLE001 - the pool still works, only with the driver's default reuse
        return f"cudaMallocAsync pool; internal dependencies left on ({type(e).__name__}: {e})"
    return "cudaMallocAsync pool shared by every lane stream, no cross-stream reuse waits"


class DeviceMemory(Protocol):
    """The memory calls of one device (``torch.cuda`` on a GPU; a fake in tests)."""

    def synchronize(self) -> None: ...
    def empty_cache(self) -> None: ...
    def reset_peak(self) -> None: ...
    def allocated(self) -> int: ...
    def peak_allocated(self) -> int: ...
    def reserved(self) -> int: ...
    def info(self) -> tuple[int, int]: ...  # (free, total)


class CudaMemory:
    """:class:`DeviceMemory` of one CUDA device through ``torch.cuda``."""

    def __init__(self, device: Any) -> None:
        self.device = device

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        import torch

        torch.cuda.empty_cache()

    def reset_peak(self) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats(self.device)

    def allocated(self) -> int:
        import torch

        return torch.cuda.memory_allocated(self.device)

    def peak_allocated(self) -> int:
        import torch

        return torch.cuda.max_memory_allocated(self.device)

    def reserved(self) -> int:
        import torch

        return torch.cuda.memory_reserved(self.device)

    def info(self) -> tuple[int, int]:
        import torch

        return torch.cuda.mem_get_info(self.device)


@dataclass(frozen=True)
class MemoryProfile:
    """Bytes after a profiling step: device ``total`` and ``free``; torch's ``reserved`` and persistent
    ``allocated`` (weights, buffers); ``peak`` of the step's activations above ``allocated``."""

    total: int
    free: int
    reserved: int
    allocated: int
    peak: int


def profile_memory(mem: DeviceMemory, step: Callable[[], None]) -> MemoryProfile:
    """Run ``step`` with the allocator's peak reset; what stays allocated, the step's peak, the device."""
    mem.synchronize()
    mem.empty_cache()
    base = mem.allocated()
    mem.reset_peak()
    step()
    mem.synchronize()
    peak = max(0, mem.peak_allocated() - base)
    mem.empty_cache()
    free, total = mem.info()
    return MemoryProfile(total=total, free=free, reserved=mem.reserved(), allocated=base, peak=peak)


def kv_budget_bytes(p: MemoryProfile, utilization: float) -> int:
    """What the KV cache may take: ``utilization`` of the device, less everything else (may be negative)."""
    others = max(0, p.total - p.free - p.reserved)  # CUDA context, cuBLAS, other processes
    return int(p.total * utilization) - others - p.allocated - p.peak
