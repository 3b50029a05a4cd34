"""The decode helper (``helper.c``): a thread on another core that takes chunks of the fused decode step's products and
attention while the lane thread takes the others, without a barrier — the lane thread waits for a helper's chunk
about two chunk times at most, then takes it back and computes it itself.

A decode step of a few sequences is memory-bound; on two cores it runs 1.5-1.8x faster than on one, but an
OpenMP team stalls at every product's barrier whenever its other thread is descheduled (in a server: the
orchestrator, a client, the prefill lane), which made two-thread decode steps slower at the tail than one-thread
ones.  The helper gives most of that speed while its core is free and costs about two chunks when it is not.

Its owner pins it (:meth:`DecodeHelper.start`), lets it take chunks or not (:meth:`DecodeHelper.allow`: the prefill
lane disallows it while it runs a step on the helper's core) and passes it to :class:`~.step.FusedDecodeStep` for
the steps it may share (one-thread steps of at most ``max_batch`` sequences).  Results are bitwise those of the
step without it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Sequence

from agentserve.executor.errors import EngineError

log = logging.getLogger(__name__)

DECODE_HELPER_SETTINGS = ("auto", "off")  # engine setting: auto = a helper wherever the fused step has a spare core
MAX_BATCH = 32  # the largest decode batch a helper shares (its scratch is sized for it)
_ptr, _i32, _i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


def _declare(library: ctypes.CDLL) -> None:
    library.fused_helper_create.argtypes = [_i32, _i32, _i64, _i64]
    library.fused_helper_create.restype = _ptr
    for name in ("fused_helper_destroy", "fused_helper_stop", "fused_helper_serve"):
        getattr(library, name).argtypes, getattr(library, name).restype = [_ptr], None
    library.fused_helper_allow.argtypes, library.fused_helper_allow.restype = [_ptr, _i32], None
    library.fused_helper_stall.argtypes, library.fused_helper_stall.restype = [_ptr, _i32, _i32], None
    library.fused_helper_counts.argtypes, library.fused_helper_counts.restype = [_ptr, ctypes.POINTER(_i64)], None


class DecodeHelper:
    """One helper thread and its C state; made by :meth:`.step.FusedDecodeStep.helper`."""

    def __init__(self, library: ctypes.CDLL, max_batch: int, max_width: int, scratch_floats: int,
                 private: int, owner: object) -> None:
        _declare(library)
        self._lib = library
        # what its jobs point into (the model, its weights, the cache the step is bound to: the runner swaps caches
        # only before helpers exist): a helper still inside a chunk of a step its lane thread has left reads them
        # until it sees the job is stale, so they live until close()
        self._owner: object | None = owner
        self.max_batch = max_batch
        self.handle = library.fused_helper_create(max_batch, max_width, scratch_floats, private)
        if not self.handle:
            raise MemoryError("decode helper: no memory for its scratch")
        self._thread: threading.Thread | None = None
        self._cores: tuple[int, ...] = ()
        self.idle = False  # the thread runs at SCHED_IDLE

    def start(self, cores: Sequence[int], idle: bool = True) -> None:
        """Start serving on a thread pinned to ``cores`` (not the lane thread's), at ``SCHED_IDLE`` unless ``idle`` is
        false (tests that need it to run beside other load)."""
        if self._thread is not None:
            raise EngineError("decode helper already started")
        self._cores = tuple(cores)
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready, idle), name="decode-helper", daemon=True)
        self._thread.start()
        ready.wait()

    def _serve(self, ready: threading.Event, idle: bool) -> None:
        tid = threading.get_native_id()
        try:
            if self._cores:
                os.sched_setaffinity(tid, self._cores)
            try:  # the orchestrator and the clients come first on its core: it takes only what they leave
                if idle:
                    os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
                    self.idle = True
            except (OSError, AttributeError) as e:
                log.info("decode helper keeps its scheduling policy: %s", e)
        finally:
            ready.set()
        self._lib.fused_helper_serve(self.handle)  # returns at close(); ctypes drops the GIL meanwhile

    @property
    def cores(self) -> tuple[int, ...]:
        return self._cores

    def allow(self, allowed: bool) -> None:
        """Let the helper take chunks (``True``) or not: it finishes the chunk it has (tens of µs), then sleeps."""
        self._lib.fused_helper_allow(self.handle, int(allowed))

    def stall(self, every: int, us: int) -> None:
        """Tests: the helper sleeps ``us`` µs inside every ``every``-th chunk it takes (the lane thread takes them
        back)."""
        self._lib.fused_helper_stall(self.handle, every, us)

    def counts(self) -> dict[str, int]:
        """Chunks the helper computed, chunks the lane thread took back from it, steps it was offered."""
        out = (_i64 * 3)()
        self._lib.fused_helper_counts(self.handle, out)
        return {"helped": out[0], "taken_back": out[1], "steps": out[2]}

    def close(self) -> None:
        """Stop the thread and free the C state (call once no step uses the helper)."""
        if self.handle is None:
            return
        self._lib.fused_helper_stop(self.handle)
        if self._thread is not None:
            self._thread.join()
        self._lib.fused_helper_destroy(self.handle)
        self.handle = None
        self._owner = None
