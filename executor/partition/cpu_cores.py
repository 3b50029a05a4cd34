"""``cpu-cores`` backend: no CUDA — the lanes are threads on disjoint cores.

A partitioned rung gives decode the first ``d`` usable cores and prefill the rest; the top rung
gives both lanes every core.  Binding a lane thread pins it (``os.sched_setaffinity`` on its
native thread id) and sets its intra-op thread count to its core count.

Per-thread intra-op threads (measured on torch 2.13, OpenMP backend, MKL): ``torch.set_num_threads``
sets the calling thread's OpenMP ``nthreads`` ICV (and MKL's thread-local count), so two lane
threads can run with different counts at once — *provided* each thread has already done torch's
lazy per-thread init (the first ``get_num_threads`` in a thread re-applies the last value set by
any thread).  :meth:`_bind` therefore calls ``get_num_threads`` before ``set_num_threads``.
Each lane thread gets its own OpenMP worker team, created with the lane's affinity mask; a worker
keeps the mask it was created with, so after a rung change a reused worker may still run on
the cores of its first rung (exact on 2 cores, where a partitioned lane has no workers).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from agentserve.executor.partition.base import LaneBinding, PartitionBackend
from agentserve.executor.partition.ladder import CPU_GRANULARITY, DEFAULT_SHARES, build_ladder
from agentserve.shm.messages import Lane, Rung


def usable_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


class CpuCoresBackend(PartitionBackend):
    name = "cpu-cores"
    unit = "cores"

    def __init__(
        self, cores: Sequence[int] | None = None, reason: str = "", shares: tuple[float, ...] = DEFAULT_SHARES
    ) -> None:
        self.cores = tuple(cores if cores is not None else usable_cores())
        if not self.cores:
            raise ValueError("no usable CPU cores")
        ladder = build_ladder(len(self.cores), CPU_GRANULARITY, shares)
        note = reason or f"lanes are threads pinned to disjoint cores ({len(self.cores)} usable)"
        super().__init__(ladder, f"cpu ({len(self.cores)} cores)", note)

    def cores_for(self, lane: Lane, rung: Rung) -> tuple[int, ...]:
        if not rung.partitioned:
            return self.cores
        d = rung.decode_units
        return self.cores[:d] if lane == Lane.DECODE else self.cores[d:]

    @contextmanager
    def _bind(self, lane: Lane, rung: Rung) -> Iterator[LaneBinding]:
        cores = self.cores_for(lane, rung)
        tid = threading.get_native_id()
        old_mask = os.sched_getaffinity(tid)
        torch.get_num_threads()  # torch's lazy per-thread init must happen before our set
        old_threads = torch.get_num_threads()
        os.sched_setaffinity(tid, cores)
        torch.set_num_threads(len(cores))
        try:
            yield LaneBinding(lane=lane, rung=rung, units=len(cores), threads=len(cores), cores=cores)
        finally:
            torch.set_num_threads(old_threads)
            os.sched_setaffinity(tid, old_mask)

    def _release(self) -> None:
        """Nothing to free: bindings restore their thread's mask and thread count on exit."""
