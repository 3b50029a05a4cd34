"""``cpu-cores`` backend: no CUDA — the lanes are threads on disjoint cores.

A partitioned rung gives decode the first ``d`` usable cores and prefill the rest; the top rung
gives both lanes every core.  Binding a lane thread pins it (``os.sched_setaffinity`` on its
native thread id) and sets its intra-op thread count to its core count.

Per-thread intra-op threads (torch's OpenMP backend, MKL): ``torch.set_num_threads`` sets the calling
thread's OpenMP ``nthreads`` ICV (and MKL's thread-local count), so two lane threads can run with
different counts at once — *provided* each thread has already done torch's lazy per-thread init (the
first ``get_num_threads`` in a thread re-applies the last value set by any thread).  :meth:`_bind`
therefore calls ``get_num_threads`` before ``set_num_threads``.  Each lane thread gets its own OpenMP
worker team, created with the lane's affinity mask; a worker keeps the mask it was created with, so
after a rung change a reused worker may still run on the cores of its first rung (exact on 2 cores,
where a partitioned lane has no workers).

A step of at most :data:`ONE_THREAD_MAX_TOKENS` tokens (a decode of a few sequences) runs on one
intra-op thread: its matmuls are memory-bound, so one thread moves nearly what two do, while a second
thread adds an OpenMP barrier per op that stalls whenever the other core is busy (the orchestrator, a
client, the prefill lane).  Larger steps use the binding's thread count.

On the shared (top) rung both lanes may use every core, and the prefill lane thread runs at
``SCHED_IDLE`` — the CPU analogue of decode's high-priority stream: decode preempts prefill, and
prefill soaks up the cycles decode leaves (between steps, Python gaps).  The lane thread's OpenMP
workers take the policy only if they are created after the switch, and keep it: a worker first
created on a partitioned rung keeps normal priority on the shared rung, and one created on the
shared rung stays idle-priority on a partitioned rung (harmless: those cores are the lane's own).
On 2 cores the first cannot happen (a partitioned lane has one core and no workers); on more cores
the shared rung's prefill can compete with decode through such workers — setting worker policies
is a known gap.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext

import torch

from agentserve.executor.partition.base import LaneBinding, PartitionBackend
from agentserve.executor.partition.ladder import CPU_GRANULARITY, DEFAULT_SHARES, build_ladder
from agentserve.protocol.lanes import CPU_CORES_BACKEND, Lane, Rung

log = logging.getLogger(__name__)

ONE_THREAD_MAX_TOKENS = 4


def usable_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def idle_is_reversible() -> str | None:
    """``None`` when a thread can go to SCHED_IDLE and back (probed on a throwaway thread), else why not.

    Leaving SCHED_IDLE needs ``CAP_SYS_NICE`` (or a generous ``RLIMIT_NICE``); without it a lane thread
    that once ran the shared rung's prefill would stay idle-priority on its own cores too.
    """
    outcome: list[str | None] = []

    def probe() -> None:
        tid = threading.get_native_id()
        try:
            old_policy, old_param = os.sched_getscheduler(tid), os.sched_getparam(tid)
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(tid, old_policy, old_param)
            outcome.append(None)
        except (OSError, AttributeError) as e:
            outcome.append(f"{type(e).__name__}: {e}")

    t = threading.Thread(target=probe, name="sched-idle-probe")
    t.start()
    t.join()
    return outcome[0] if outcome else "probe thread died"


@contextmanager
def idle_priority(tid: int) -> Iterator[bool]:
    """Run thread ``tid`` at ``SCHED_IDLE`` (a core only when nothing else wants it); yield whether it took.

    The CPU analogue of a low-priority stream: on the shared rung the decode lane's threads preempt the
    prefill lane.  Restoring the old policy can need ``CAP_SYS_NICE``; without it the thread stays idle.
    """
    try:
        old_policy, old_param = os.sched_getscheduler(tid), os.sched_getparam(tid)
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError) as e:
        log.info("prefill lane keeps its scheduling policy: %s", e)
        yield False
        return
    try:
        yield True
    finally:
        try:
            os.sched_setscheduler(tid, old_policy, old_param)
        except OSError as e:
            log.warning("prefill lane thread stays at SCHED_IDLE: %s", e)


class CpuCoresBackend(PartitionBackend):
    name = CPU_CORES_BACKEND
    unit = "cores"

    def __init__(
        self,
        cores: Sequence[int] | None = None,
        reason: str = "",
        shares: tuple[float, ...] = DEFAULT_SHARES,
        idle_prefill_when_shared: bool = True,
    ) -> None:
        self.cores = tuple(cores if cores is not None else usable_cores())
        why_not = idle_is_reversible() if idle_prefill_when_shared else "disabled"
        self.idle_prefill_when_shared = why_not is None
        if not self.cores:
            raise ValueError("no usable CPU cores")
        ladder = build_ladder(len(self.cores), CPU_GRANULARITY, shares)
        shared = (
            "on the shared rung the prefill lane runs at SCHED_IDLE so decode comes first"
            if why_not is None
            else f"the shared rung's prefill lane keeps normal priority (SCHED_IDLE: {why_not})"
        )
        note = reason or f"lanes are threads pinned to disjoint cores ({len(self.cores)} usable); {shared}"
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
        background = lane == Lane.PREFILL and not rung.partitioned and self.idle_prefill_when_shared
        try:
            with idle_priority(tid) if background else nullcontext(False) as idle:
                yield LaneBinding(lane, rung, len(cores), threads=len(cores), cores=cores, idle=idle)
        finally:
            torch.set_num_threads(old_threads)
            os.sched_setaffinity(tid, old_mask)

    @contextmanager
    def step_scope(self, binding: LaneBinding, num_tokens: int) -> Iterator[None]:
        """One intra-op thread for a step of at most ``ONE_THREAD_MAX_TOKENS`` tokens, the binding's count otherwise."""
        want = 1 if num_tokens <= ONE_THREAD_MAX_TOKENS else max(1, binding.threads)
        before = torch.get_num_threads()  # the binding's, or a running step's when this one runs inside it
        if want == before:
            yield
            return
        torch.set_num_threads(want)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def _release(self) -> None:
        """Nothing to free: bindings restore their thread's mask and thread count on exit."""
