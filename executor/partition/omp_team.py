"""Re-pinning a lane thread's OpenMP workers when its cores change (``omp_team.c``, in the CPU library).

``os.sched_setaffinity`` moves one thread; the OpenMP workers PyTorch's products run on keep the mask they
were created with.  So on more than two cores a lane that narrows (the prefill lane giving the decode lane's
cores back, either lane moving down a rung) could leave workers runnable on the other lane's cores.
:func:`pin_team` moves them too, by running one parallel region in the calling thread that sets each team
thread's mask.  That reaches PyTorch's workers only when the library shares PyTorch's OpenMP runtime (one
libgomp in the process, as with the current PyTorch wheels for Linux; older ones bundled a renamed copy);
:func:`shares_torch_runtime` checks it once, by whether a thread count set through the library is what
PyTorch then reports.  Where it is not shared, or there is no C compiler, the workers keep their masks
(logged once) and nothing else changes.  :func:`release_team` ends the calling thread's idle workers (a lane holds
none between its wide steps, but for the prefill lane beside a one-core decode lane: see there why).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from agentserve.executor.kernels.build import library

log = logging.getLogger(__name__)


class _Functions(NamedTuple):
    max_threads: Callable[[], int]
    set_threads: Callable[[int], None]
    pin: Callable[..., int]
    masks: Callable[..., int]
    release: Callable[[], int]


@functools.cache
def _functions() -> _Functions | None:
    lib = library()
    if lib is None:
        return None
    fns = _Functions(lib.agentserve_omp_max_threads, lib.agentserve_omp_set_num_threads, lib.agentserve_pin_team,
                     lib.agentserve_team_masks, lib.agentserve_release_team)
    fns.release.argtypes, fns.release.restype = [], ctypes.c_int  # type: ignore[attr-defined]
    fns.max_threads.argtypes, fns.max_threads.restype = [], ctypes.c_int  # type: ignore[attr-defined]
    fns.set_threads.argtypes, fns.set_threads.restype = [ctypes.c_int], None  # type: ignore[attr-defined]
    fns.pin.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_int,  # type: ignore[attr-defined]
                        ctypes.c_int]
    fns.masks.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_uint64)]  # type: ignore[attr-defined]
    fns.pin.restype = fns.masks.restype = ctypes.c_int  # type: ignore[attr-defined]
    return fns


@functools.cache
def shares_torch_runtime() -> bool:
    """Whether the CPU library's OpenMP runtime is PyTorch's: checked once (the cpu-cores backend asks when it is
    made), by setting the calling thread's thread count through the library and reading it back through
    PyTorch (which leaves PyTorch's own settings alone)."""
    fns = _functions()
    if fns is None:
        log.info("OpenMP workers keep their first affinity mask: the CPU library is unavailable")
        return False
    if fns.max_threads() < 0:
        log.info("OpenMP workers keep their first affinity mask: the CPU library was built without OpenMP")
        return False
    before = torch.get_num_threads()
    seen = []
    try:
        for n in (before + 1, before + 2):
            fns.set_threads(n)
            seen.append(torch.get_num_threads())
    finally:
        fns.set_threads(before)
    shared = seen == [before + 1, before + 2]
    if not shared:
        log.info("OpenMP workers keep their first affinity mask: the CPU library's OpenMP runtime is not "
                 "PyTorch's (PyTorch saw %s threads where the library set %d and %d)", seen, before + 1, before + 2)
    return shared


def pin_team(cores: Sequence[int], threads: int, one_core_each: bool = True) -> bool:
    """Pin the calling thread and the first ``threads - 1`` workers of its OpenMP team to ``cores``: team thread
    ``i`` to ``cores[i % len(cores)]`` alone (the calling thread to ``cores[0]``), or with ``one_core_each=False``
    each of them to all of ``cores``.

    One core each, because a team pinned to a shared mask is placed by the kernel's scheduler, which starts a new
    worker beside the thread that woke it and moves it only at its next balancing: a two-thread prefill step on two
    cores then ran both halves of every product on one core for part of the step (seen in a server's scheduler
    trace) while the other core idled.  Whether they were moved (``False`` where the runtime is not shared or a mask
    could not be set); a team of one thread has no workers and needs nothing."""
    if threads <= 1 or not shares_torch_runtime():
        return False
    fns = _functions()
    assert fns is not None
    cpus = (ctypes.c_int * len(cores))(*cores)
    return fns.pin(threads, cpus, len(cores), int(one_core_each)) == 0


def release_team() -> bool:
    """End the calling thread's idle OpenMP workers (PyTorch's too, where the runtime is shared); its next product on
    more than one thread starts new ones, on the thread's cores as they are then.  Whether they were ended.

    libgomp lets a waiting worker spin before it sleeps only while it manages at most as many threads as there are
    CPUs, and it counts every thread's pool of idle workers: with the loading thread's pool and one per lane alive
    on two cores, every worker slept at every barrier and had to be woken, and a two-thread prefill step took
    1.4-1.9x its time alone (docs/executor.md).  So a thread that will not run products on several threads for a while
    calls this; never inside a parallel region."""
    if not shares_torch_runtime():
        return False
    fns = _functions()
    assert fns is not None
    return fns.release() == 0


def team_masks(threads: int) -> list[set[int]] | None:
    """Each thread's mask (CPUs below 64) in a team of ``threads`` started by the calling thread, master
    first; ``None`` without the library or OpenMP.  For tests and diagnostics."""
    fns = _functions()
    if fns is None:
        return None
    out = (ctypes.c_uint64 * threads)()
    size = fns.masks(threads, out)
    if size < 0:
        return None
    return [{c for c in range(64) if out[i] >> c & 1} for i in range(size)]
