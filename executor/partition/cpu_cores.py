"""``cpu-cores`` backend: no CUDA — the lanes are threads on disjoint cores.

A partitioned rung gives decode the first ``d`` usable cores and prefill the rest; the top rung
gives both lanes every core.  Binding a lane thread pins it (``os.sched_setaffinity`` on its
native thread id) and sets its intra-op thread count to its core count.

Per-thread intra-op threads (torch's OpenMP backend, MKL): ``torch.set_num_threads`` sets the calling
thread's OpenMP ``nthreads`` ICV (and MKL's thread-local count), so two lane threads can run with
different counts at once — *provided* each thread has already done torch's lazy per-thread init (the
first ``get_num_threads`` in a thread re-applies the last value set by any thread).  :meth:`_bind`
therefore calls ``get_num_threads`` before ``set_num_threads``.  Each lane thread gets its own OpenMP
worker team; a worker keeps the mask it was created with, so whenever a lane's cores change its team is
re-pinned with it (:func:`~.omp_team.pin_team`; where the compiled library does not share PyTorch's OpenMP
runtime, a reused worker may still run on the cores of an earlier rung — exact on 2 cores, where a
partitioned lane has no workers).  Idle workers are ended (:func:`~.omp_team.release_team`: the loader's when the
backend is made, a lane's after binding, after each step on several threads, and when the loan narrows a prefill
step to one thread) — libgomp counts every pool's idle workers, and with more than there are CPUs it makes every
barrier of every step sleep — except, where decode's partition is one core (as on two), the shared-rung prefill
lane's between its steps: parked on the cores they ran on, asleep after the executor's short spin
(``GOMP_SPINCOUNT``), and woken there by its next wide step (a new one started beside the lane thread and took ~1 ms
to reach its core).  A one-core decode lane has no workers, so the pools then hold at most one thread per core.

A step of at most :data:`ONE_THREAD_MAX_TOKENS` tokens (a decode of a few sequences) runs on one
intra-op thread: its matmuls are memory-bound, so one thread moves nearly what two do, while a second
thread adds an OpenMP barrier per op that stalls whenever the other core is busy (the orchestrator, a
client, the prefill lane).  Larger steps use the binding's thread count.  A one-thread decode lane step gets the
decode helper instead (:mod:`agentserve.executor.fused.helper`: a thread on the cores decode's home rung leaves to
prefill, sharing the fused step without a barrier), kept off those cores while a prefill lane step runs.

On the shared (top) rung the prefill lane borrows the decode lane's cores while decode is idle and
returns them at its next layer boundary when a decode step wants them (:mod:`.core_loan`): the prefill
lane thread's affinity and intra-op thread count follow, between its layers, whether it holds them.
Decode's cores are those of its partitioned binding (the ladder's first partitioned rung until it has
one); when decode moves to a rung whose cores a running prefill step still holds, its next step waits for
that step's next refit too.  The scheduler keeps decode off the shared rung while it lends (with decode
there, both lanes would spread over every core at normal priority).  On more than two cores a narrowed
prefill runs several threads: its OpenMP workers are re-pinned with it, or (runtime not shared) may stay
runnable on decode's cores.

With ``lend_decode_cores=False`` the old rule holds instead: the shared rung's prefill lane thread runs
at ``SCHED_IDLE`` — decode preempts prefill, and prefill soaks up the cycles decode leaves.  But an
idle-priority thread also waits behind the orchestrator and the clients, and a prefill step split over
two threads stalls at every op's barrier while decode holds one of its cores, so a chunk begun while
nothing decoded crawled once decode started beside it.  The lane thread's OpenMP workers take the
policy only if they are created after the switch, and keep it (a known gap on more than two cores).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext

import torch

from agentserve.executor.fused.helper import DecodeHelper
from agentserve.executor.partition.base import LaneBinding, PartitionBackend
from agentserve.executor.partition.core_loan import CoreLoan
from agentserve.executor.partition.ladder import CPU_GRANULARITY, DEFAULT_SHARES, build_ladder
from agentserve.executor.partition.omp_team import pin_team, release_team, shares_torch_runtime
from agentserve.protocol.lanes import CPU_CORES_BACKEND, Lane, Rung, openmp_binding

log = logging.getLogger(__name__)

ONE_THREAD_MAX_TOKENS = 4


def step_threads(num_tokens: int, available: int) -> int:
    """Intra-op threads for a step: one for at most ``ONE_THREAD_MAX_TOKENS`` tokens, else ``available``."""
    return 1 if num_tokens <= ONE_THREAD_MAX_TOKENS else max(1, available)


def usable_cores() -> list[int]:
    """The calling process's CPUs (its first thread's mask); says so when OpenMP's binding settings narrowed it."""
    cores = sorted(os.sched_getaffinity(0))
    bound = openmp_binding(os.environ)
    if bound:
        log.warning("%s is set: OpenMP pinned this process's first thread as it loaded, so the lanes see CPU(s) %s "
                    "only; unset it (`agentserve up` starts its executor without it)", ", ".join(bound), cores)
    return cores


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
        lend_decode_cores: bool = True,
    ) -> None:
        self.cores = tuple(cores if cores is not None else usable_cores())
        if not self.cores:
            raise ValueError("no usable CPU cores")
        ladder = build_ladder(len(self.cores), CPU_GRANULARITY, shares)
        home = next((r for r in ladder if r.partitioned), None)
        self.loan = CoreLoan() if lend_decode_cores and home is not None else None
        self._decode_home = self.cores[: home.decode_units] if home is not None else ()
        self._prefill_steps: list[int] = []  # tokens of the prefill lane's running steps (a preempting one nests)
        self._prefill_view: tuple[tuple[int, ...], int] | None = None  # its cores and threads inside a step
        self._helper: DecodeHelper | None = None  # the decode lane's helper, on the cores decode's home leaves
        self._prefill_running = 0  # prefill lane steps running (a preempting one nests): the helper waits them out
        if self.loan is not None:
            self.idle_prefill_when_shared = False
            shared = "on the shared rung the prefill lane borrows decode's cores while decode is idle"
        else:
            why_not = idle_is_reversible() if idle_prefill_when_shared else "disabled"
            self.idle_prefill_when_shared = why_not is None
            shared = (
                "on the shared rung the prefill lane runs at SCHED_IDLE so decode comes first"
                if why_not is None
                else f"the shared rung's prefill lane keeps normal priority (SCHED_IDLE: {why_not})"
            )
        shares_torch_runtime()  # now, not in a lane's first binding: it may build the CPU library (seconds)
        release_team()  # the model loader's idle workers (this thread only reads rings from now on)
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
        if lane == Lane.DECODE and rung.partitioned:
            self._decode_home = cores
            view = self._prefill_view  # set by the prefill lane thread; one read of a tuple
            if self.loan is not None and view is not None and set(view[0]) & set(cores):
                self.loan.reclaim()  # decode moved onto cores a running prefill step holds: wait for its refit
        try:
            if not release_team():  # else its next workers start on these cores
                pin_team(cores, len(cores))
            with idle_priority(tid) if background else nullcontext(False) as idle:
                yield LaneBinding(lane, rung, len(cores), threads=len(cores), cores=cores, idle=idle)
        finally:
            torch.set_num_threads(old_threads)
            os.sched_setaffinity(tid, old_mask)
            if not release_team():
                pin_team(sorted(old_mask), min(old_threads, len(cores), len(old_mask)), one_core_each=False)

    def attach_decode_helper(self, helper: DecodeHelper) -> bool:
        """The helper runs on the cores decode's home rung leaves to prefill (none on one core): it takes chunks of
        the decode lane's one-thread steps while no prefill lane step runs."""
        spare = [c for c in self.cores if c not in self._decode_home]
        if not self._decode_home or not spare or self._helper is not None:  # no partitioned rung on one core
            return False
        helper.start(spare)
        self._helper = helper
        log.info("decode helper: a thread on CPU(s) %s shares one-thread decode steps while the prefill lane is idle",
                 spare)
        return True

    @contextmanager
    def step_scope(self, binding: LaneBinding, num_tokens: int, hold_cores: bool = False,
                   decode_idle: bool = False) -> Iterator[DecodeHelper | None]:
        """One intra-op thread for a step of at most ``ONE_THREAD_MAX_TOKENS`` tokens, the binding's count otherwise;
        with the core loan, a decode step first takes its cores back and a shared-rung prefill step borrows them
        (with ``hold_cores``, to its end: :meth:`.CoreLoan.hold`; with ``decode_idle``, from its start:
        :meth:`.CoreLoan.burst_ended`).  A decode lane step on one thread gets the decode helper; a prefill lane
        step keeps it off its cores while it runs."""
        if binding.lane == Lane.PREFILL:
            with self._helper_off():
                if self.loan is not None and not binding.rung.partitioned:
                    with self._borrowing(binding, num_tokens, hold_cores, decode_idle):
                        yield None
                    return
                with self._threads(step_threads(num_tokens, binding.threads)):
                    yield None
            return
        waiting = self.loan.decode_step() if self.loan is not None else nullcontext()
        threads = step_threads(num_tokens, binding.threads)
        helper = self._helper if threads == 1 else None
        with waiting, self._threads(threads), self._beside(helper, binding):
            yield helper

    @staticmethod
    @contextmanager
    def _beside(helper: DecodeHelper | None, binding: LaneBinding) -> Iterator[None]:
        """A decode lane thread whose cores include the helper's (the top rung) runs its step on the others: on the
        helper's core the helper, at ``SCHED_IDLE``, would get no time beside it."""
        own = () if helper is None else tuple(c for c in binding.cores if c not in helper.cores)
        if not own or len(own) == len(binding.cores):
            yield
            return
        tid = threading.get_native_id()
        os.sched_setaffinity(tid, own)
        try:
            yield
        finally:
            os.sched_setaffinity(tid, binding.cores)

    @contextmanager
    def _helper_off(self) -> Iterator[None]:
        """A prefill lane step: the decode helper takes no chunks until it ends (it finishes the one it has)."""
        helper = self._helper
        self._prefill_running += 1
        if helper is not None:
            helper.allow(False)
        try:
            yield
        finally:
            self._prefill_running -= 1
            if helper is not None and self._prefill_running == 0:
                helper.allow(True)

    @staticmethod
    @contextmanager
    def _threads(want: int) -> Iterator[None]:
        """``want`` intra-op threads for one step; a step on several ends its workers after it (:func:`release_team`:
        idle workers of any thread make every other thread's barriers sleep, and a spinning one takes a core)."""
        before = torch.get_num_threads()  # the binding's, or a running step's when this one runs inside it
        if want != before:
            torch.set_num_threads(want)
        try:
            yield
        finally:
            if want != before:
                torch.set_num_threads(before)
            if want > 1:
                release_team()

    @contextmanager
    def _borrowing(self, binding: LaneBinding, num_tokens: int, hold: bool, decode_idle: bool) -> Iterator[None]:
        """A prefill step on the shared rung: on every core while decode lends them (or to its end, held), refitted
        between layers."""
        loan = self.loan
        assert loan is not None
        if decode_idle:
            loan.burst_ended()
        if hold:
            loan.hold()
        self._prefill_steps.append(num_tokens)
        try:
            self._fit(binding)
            yield
        finally:
            self._prefill_steps.pop()
            if hold:
                loan.end_hold()
            if self._prefill_steps:
                self._fit(binding)  # a preempting step ran inside a chunk: the chunk's width again
            else:  # between steps: the cores returned, the lane thread on its own cores, where its next step starts;
                if len(self._decode_home) > 1:  # its workers stay parked beside a one-core decode lane only (see the
                    release_team()  # module docstring): decode's own workers would make the pools outnumber the cores
                own = self._own_cores(binding) or binding.cores
                os.sched_setaffinity(threading.get_native_id(), own)
                torch.set_num_threads(len(own))
                self._prefill_view = None
                loan.give_back()

    def between_layers(self, binding: LaneBinding) -> None:
        """The prefill lane between two layers of a shared-rung step: widen or narrow as decode needs its cores."""
        if self.loan is not None and self._prefill_steps and binding.lane == Lane.PREFILL:
            self._fit(binding)

    def _fit(self, binding: LaneBinding) -> None:
        loan = self.loan
        assert loan is not None
        own = self._own_cores(binding)
        wide = not own or loan.held or (not loan.wanted_back() if loan.lent else loan.try_borrow())
        cores = binding.cores if wide else own
        self._apply(cores, step_threads(self._prefill_steps[-1], len(cores)))
        if not wide:
            loan.give_back()

    def _own_cores(self, binding: LaneBinding) -> tuple[int, ...]:
        """The prefill lane's cores when it gives decode's back (none: nothing is lent on one core)."""
        return tuple(c for c in binding.cores if c not in self._decode_home)

    def _apply(self, cores: tuple[int, ...], threads: int) -> None:
        """Pin the calling (prefill lane) thread to ``cores`` with ``threads`` intra-op threads, if not already;
        its OpenMP workers follow when the cores change or the team grows (a worker parked by one-thread steps
        kept the mask it had).  One core per team thread, the lane's own first: the lane thread stays on its own
        core, and the workers on decode's are the ones a narrowing ends."""
        cores = tuple(sorted(cores, key=lambda c: c in self._decode_home))
        view = self._prefill_view
        if view == (cores, threads):
            return
        if view is None or view[0] != cores:
            os.sched_setaffinity(threading.get_native_id(), cores)
        torch.set_num_threads(threads)
        if threads == 1 and view is not None and view[1] > 1:
            release_team()  # a narrowed step's idle worker would spin on the cores just given back
        elif view is None or view[0] != cores or threads > view[1]:
            pin_team(cores, threads)
        self._prefill_view = (cores, threads)

    def _release(self) -> None:
        """Nothing to free (bindings restore their thread's mask and threads on exit); logs the loan's tally."""
        if self.loan is not None:
            loan = self.loan
            mean_ms = 1e3 * loan.wait_s / loan.waits if loan.waits else 0.0
            log.info("core loan: the prefill lane borrowed decode's cores %d times (%d held to a step's end); "
                     "%d decode steps waited for them (%.1f ms on average), %d ran before they came back (after %.0f "
                     "ms, %.0f ms held)", loan.borrows, loan.holds, loan.waits, mean_ms, loan.late_returns,
                     1e3 * loan.return_timeout_s, 1e3 * loan.hold_timeout_s)
