"""Pick a partition backend: green-ctx → cuda-streams → cpu-cores, recording why each fell through."""

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
from agentserve.executor.partition.torch_green import TorchGreenCtxBackend

log = logging.getLogger(__name__)

ORDER = ("green-ctx", "cuda-streams", "cpu-cores")


def _green(driver: Any, cuda: TorchCuda, shares: tuple[float, ...]) -> PartitionBackend:
    """The driver path first, then torch's green contexts; both reasons when neither works."""
    try:
        return GreenCtxBackend(driver if driver is not None else load_driver(), cuda, cuda.index, shares)
    except (BackendUnavailable, CudaCallError) as e:
        driver_reason = f"cuda.bindings: {e}"
    try:
        backend = TorchGreenCtxBackend(cuda, shares)
    except BackendUnavailable as e:
        raise BackendUnavailable(f"{driver_reason}; torch.cuda.green_contexts: {e}") from e
    backend.reason = f"{driver_reason}; using {backend.reason}"
    return backend


def detect(
    prefer: str | None = None,
    *,
    driver: Any = None,
    cuda: TorchCuda | None = None,
    shares: tuple[float, ...] = DEFAULT_SHARES,
    cores: list[int] | None = None,
) -> PartitionBackend:
    """The first backend in ``ORDER`` (starting at ``prefer``) that works here.

    ``driver`` (a ``cuda.bindings.driver``-shaped module) and ``cuda`` (a :class:`TorchCuda`) are
    seams for tests.  The chosen backend's ``reason`` lists every earlier backend's failure.
    """
    if prefer is not None and prefer not in ORDER:
        raise ValueError(f"unknown partition backend {prefer!r}; choose from {', '.join(ORDER)}")
    cuda = cuda or TorchCuda(0)
    makers: dict[str, Callable[[], PartitionBackend]] = {
        "green-ctx": lambda: _green(driver, cuda, shares),
        "cuda-streams": lambda: CudaStreamsBackend(cuda),
        "cpu-cores": lambda: CpuCoresBackend(cores, shares=shares),
    }
    order = ORDER[ORDER.index(prefer) :] if prefer else ORDER
    failures: list[str] = []
    for name in order:
        try:
            backend = makers[name]()
        except BackendUnavailable as e:
            failures.append(f"{name} unavailable: {e}")
            log.info("partition backend %s unavailable: %s", name, e)
            continue
        backend.reason = "; ".join([*failures, f"{name}: {backend.reason}"])
        return backend
    raise BackendUnavailable("; ".join(failures))  # cpu-cores only fails with no usable core
