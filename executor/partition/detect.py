"""Pick a partition backend: green-ctx → cuda-streams → cpu-cores, recording why each fell through.

A backend that fails in *any* way — a ``BackendUnavailable``, a CUDA error, or an ``AttributeError`` from
bindings of another version — is skipped with its reason; only the last resort (cpu-cores) may raise.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from agentserve.executor.partition.base import BackendUnavailable, PartitionBackend
from agentserve.executor.partition.cpu_cores import CpuCoresBackend
from agentserve.executor.partition.cuda_streams import CudaStreamsBackend
from agentserve.executor.partition.driver import CudaCallError, load_driver
from agentserve.executor.partition.green_ctx import GreenCtxBackend
from agentserve.executor.partition.ladder import DEFAULT_SHARES
from agentserve.executor.partition.torch_cuda import TorchCuda
from agentserve.executor.partition.torch_green import why_not_torch_green

log = logging.getLogger(__name__)

ORDER = ("green-ctx", "cuda-streams", "cpu-cores")


def failure(e: BaseException) -> str:
    """A fallback reason: the message of our own errors, the type and message of anything else."""
    if isinstance(e, BackendUnavailable | CudaCallError):
        return str(e)
    return f"{type(e).__name__}: {e}"


def _green(driver: Any, cuda: TorchCuda, shares: tuple[float, ...]) -> PartitionBackend:
    """The driver path; when it fails, the reason says why torch's green contexts are no substitute."""
    try:
        return GreenCtxBackend(driver if driver is not None else load_driver(), cuda, shares)
    except Exception as e:
        torch_note = why_not_torch_green()
        raise BackendUnavailable(f"cuda.bindings: {failure(e)}; torch.cuda.green_contexts: {torch_note}") from e


def detect(
    prefer: str | None = None,
    *,
    driver: Any = None,
    cuda: TorchCuda | None = None,
    shares: tuple[float, ...] = DEFAULT_SHARES,
    cores: list[int] | None = None,
) -> PartitionBackend:
    """The first backend in ``ORDER`` (starting at ``prefer``) that works here.

    ``cuda`` names the device (``TorchCuda(index)``, default device 0); ``driver`` (a
    ``cuda.bindings.driver``-shaped module) and ``cuda`` are seams for tests.  The chosen backend's
    ``reason`` lists every earlier backend's failure.
    """
    if prefer is not None and prefer not in ORDER:
        raise ValueError(f"unknown partition backend {prefer!r}; choose from {', '.join(ORDER)}")
    gpu = cuda or TorchCuda(0)
    makers: dict[str, Callable[[], PartitionBackend]] = {
        "green-ctx": lambda: _green(driver, gpu, shares),
        "cuda-streams": lambda: CudaStreamsBackend(gpu),
        "cpu-cores": lambda: CpuCoresBackend(cores, shares=shares),
    }
    order = ORDER[ORDER.index(prefer) :] if prefer else ORDER
    failures: list[str] = []
    for name in order:
        try:
            backend = makers[name]()
        except Exception as e:
            if name == order[-1] and not isinstance(e, BackendUnavailable):
                raise
            failures.append(f"{name} unavailable: {failure(e)}")
            log.info("partition backend %s unavailable: %s", name, failures[-1])
            continue
        backend.reason = "; ".join([*failures, f"{name}: {backend.reason}"])
        return backend
    raise BackendUnavailable("; ".join(failures))  # cpu-cores only fails with no usable core
