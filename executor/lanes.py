"""Lane workers: one thread per lane (decode, prefill), bound to its partition, running steps in order.

A :class:`LaneWorker` knows nothing of rings or models: the executor submits *step functions*
``fn(binding) -> result`` and gets a :class:`LaneStep` back (a future plus a completion
:class:`Marker`).  Invariants:

- Steps of one lane run one at a time, in submission order, on the lane's own thread.
- The lane is rebound to another rung only between steps (``rung=`` on submit, or :meth:`rebind`).
- A step submitted with ``after=[markers]`` starts only once those markers are complete; with CUDA
  the wait is enqueued on the lane's stream (``stream.wait_event``), so a sequence's prefill on the
  prefill lane is ordered before its first decode on the decode lane without a host sync.
- Every step records the idle gap before it (time since the lane's previous step ended), the time
  spent waiting on markers, and its own duration.
- A step submitted with ``preempt=True`` runs, on a backend whose steps run on the host (CPU cores),
  between two layers of the step this lane is running, inside it (:meth:`LaneWorker.run_preempting`,
  called from the model's layer hook) once the markers it waits on are complete; otherwise (not ready
  yet, no layer boundary left, a GPU — whose host queues a step's layers long before they run, and whose
  attention plans are per thread) in its turn, as a plain step.  So on a
  CPU a resume sent ahead of a cold chunk in flight waits for about one layer of the chunk, not all of it,
  and its result comes back before the chunk's.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from agentserve.executor.layer_hook import layer_callback
from agentserve.executor.partition.base import LaneBinding, PartitionBackend
from agentserve.protocol.lanes import Lane

log = logging.getLogger(__name__)
T = TypeVar("T")


class Marker:
    """Completion of one step: a host event, plus a CUDA event recorded on the step's stream."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.cuda_event: Any = None
        self.error: BaseException | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def complete(self, binding: LaneBinding | None = None) -> None:
        if binding is not None and binding.stream is not None:
            self.cuda_event = binding.stream.record_event()
        self._done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._done.set()

    def wait(self, binding: LaneBinding | None = None, timeout: float | None = None) -> None:
        """Block until the step ran; order GPU work after it (on ``binding``'s stream, else the host)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"marker not complete after {timeout}s")
        if self.error is not None:
            raise RuntimeError(f"awaited step failed: {self.error!r}") from self.error
        if self.cuda_event is not None:
            if binding is not None and binding.stream is not None:
                binding.stream.wait_event(self.cuda_event)
            else:
                self.cuda_event.synchronize()


class SeqReady:
    """Per-sequence readiness: the marker of the last step that wrote a sequence's KV (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._markers: dict[int, Marker] = {}

    def mark(self, seq_ids: Iterable[int], marker: Marker) -> None:
        with self._lock:
            for sid in seq_ids:
                self._markers[sid] = marker

    def pending(self, seq_ids: Iterable[int]) -> list[Marker]:
        """Distinct markers the given sequences still depend on (completed host-only ones dropped)."""
        with self._lock:
            found = {id(m): m for sid in seq_ids if (m := self._markers.get(sid)) is not None}
        return [m for m in found.values() if not (m.done() and m.cuda_event is None and m.error is None)]

    def drop(self, seq_ids: Iterable[int]) -> None:
        with self._lock:
            for sid in seq_ids:
                self._markers.pop(sid, None)


@dataclass
class StepTiming:
    """One step of one lane; times are ``time.monotonic()`` seconds."""

    index: int
    rung: int
    gap_s: float  # the lane's idle time before this step (since its previous step ended)
    wait_s: float  # of which waiting on other lanes' markers
    start: float
    end: float

    @property
    def duration_s(self) -> float:
        return self.end - self.start


@dataclass
class LaneStep(Generic[T]):
    future: Future[T] = field(default_factory=Future)
    marker: Marker = field(default_factory=Marker)

    def result(self, timeout: float | None = None) -> T:
        return self.future.result(timeout)


@dataclass
class _Item:
    fn: Callable[[LaneBinding], Any]
    after: tuple[Marker, ...]
    rung: int | None
    step: LaneStep[Any]


_STOP = object()


class _Preempting:
    """What the queue holds for a preempting step: run it in its turn unless it already ran inside a step."""

    __slots__ = ("item",)

    def __init__(self, item: _Item) -> None:
        self.item = item


class LaneWorker:
    """The thread of one lane. ``start()`` binds it to ``rung``; ``stop()`` unbinds and joins it."""

    def __init__(
        self, backend: PartitionBackend, lane: Lane, rung: int = 0, history: int = 4096, name: str = ""
    ) -> None:
        backend.rung(rung)  # validate early
        self.backend = backend
        self.lane = Lane(lane)
        self._want_rung = rung
        self.bound_rung: int | None = None
        self.timings: deque[StepTiming] = deque(maxlen=history)
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._bound = threading.Event()
        self._bind_error: BaseException | None = None
        self._count = 0
        self._stopping = False
        self._submit_lock = threading.Lock()
        self._preempting: deque[_Item] = deque()  # preempting steps not yet run, in submission order
        self._binding: LaneBinding | None = None  # while bound (lane thread only)
        self._last_end = 0.0  # when the lane's last step ended (lane thread only)
        self._thread = threading.Thread(target=self._run, name=name or f"lane-{self.lane.name.lower()}", daemon=True)

    def start(self, timeout: float = 10.0) -> LaneWorker:
        self._thread.start()
        if not self._bound.wait(timeout):
            raise TimeoutError(f"{self._thread.name} did not bind within {timeout}s")
        if self._bind_error is not None:
            raise RuntimeError(f"{self._thread.name} could not bind") from self._bind_error
        return self

    def submit(
        self, fn: Callable[[LaneBinding], T], *, after: Iterable[Marker] = (), rung: int | None = None,
        preempt: bool = False,
    ) -> LaneStep[T]:
        """Queue ``fn(binding)``; ``rung`` rebinds the lane before this step (and for the ones after);
        ``preempt``: run it inside the running step, at its next layer boundary (see the module's doc)."""
        if rung is not None:
            self.backend.rung(rung)
        step: LaneStep[T] = LaneStep()
        item = _Item(fn, tuple(after), rung, step)
        with self._submit_lock:  # nothing is queued behind the stop sentinel
            if self._stopping:
                raise RuntimeError(f"{self._thread.name} is stopped")
            if preempt:
                self._preempting.append(item)
            self._queue.put(_Preempting(item) if preempt else item)
        return step

    def run_preempting(self) -> None:
        """Run the preempting steps, oldest first, inside the running step, up to the first whose markers are
        not complete (lane thread only; the model's layer hook calls it between layers)."""
        if not self._preempting:  # the common case, once per layer: no lock
            return
        while (item := self._take_preempting()) is not None:
            with layer_callback(self._refit):  # one level: a preempting step is not preempted in turn
                self._last_end = self._step(item, self._binding, self._last_end)

    def _between_layers(self) -> None:
        """A CPU lane's layer hook: preempting steps first, then the backend's between-layer work (the core loan)."""
        self.run_preempting()
        self._refit()

    def _refit(self) -> None:
        """The backend's between-layer work alone (inside a preempting step too: decode may want its cores back)."""
        if self._binding is not None:
            self.backend.between_layers(self._binding)

    def _take_preempting(self, item: _Item | None = None) -> _Item | None:
        """``item`` if it has not run yet (its turn in the queue); else the oldest one if its markers are done."""
        with self._submit_lock:
            if item is not None:
                if item not in self._preempting:
                    return None
                self._preempting.remove(item)
                return item
            if not self._preempting or not all(m.done() for m in self._preempting[0].after):
                return None
            return self._preempting.popleft()

    def rebind(self, rung: int) -> None:
        """Move to ``rung`` at the next step boundary."""
        self.backend.rung(rung)
        self._want_rung = rung

    def stop(self, timeout: float = 10.0) -> None:
        """Finish the queued steps, unbind, join."""
        with self._submit_lock:
            first = not self._stopping
            self._stopping = True
        if first and self._thread.is_alive():
            self._queue.put(_STOP)
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"{self._thread.name} did not stop within {timeout}s")

    def __enter__(self) -> LaneWorker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the lane thread -----------------------------------------------------------------------

    def _run(self) -> None:
        stack = ExitStack()
        try:
            binding = self._bind(stack, self._want_rung)
        except BaseException as e:
            self._bind_error = e
            self._bound.set()
            return
        self._bound.set()
        self._last_end = time.monotonic()
        try:
            while (item := self._queue.get()) is not _STOP:
                if isinstance(item, _Preempting) and (item := self._take_preempting(item.item)) is None:
                    continue  # it ran inside an earlier step
                if item.rung is not None:
                    self._want_rung = item.rung
                if self._want_rung != self.bound_rung:
                    try:
                        stack.close()
                        self.bound_rung = None
                        binding = self._bind(stack, self._want_rung)
                    except BaseException as e:
                        self._fail(item, e)
                        continue
                with layer_callback(self._between_layers if self.backend.unit == "cores" else None):
                    self._last_end = self._step(item, binding, self._last_end)
        finally:
            stack.close()
            self.bound_rung = self._binding = None

    def _fail(self, item: _Item, error: BaseException) -> None:
        log.warning("%s step failed: %r", self._thread.name, error)
        item.step.marker.fail(error)
        item.step.future.set_exception(error)

    def _bind(self, stack: ExitStack, rung: int) -> LaneBinding:
        binding = self._binding = stack.enter_context(self.backend.lane_context(self.lane, rung))
        self.bound_rung = rung
        return binding

    def _step(self, item: _Item, binding: LaneBinding, last_end: float) -> float:
        t_wait = time.monotonic()
        try:
            for marker in item.after:
                marker.wait(binding)
            start = time.monotonic()
            result = item.fn(binding)
        except BaseException as e:
            self._fail(item, e)
            return time.monotonic()
        end = time.monotonic()
        item.step.marker.complete(binding)
        item.step.future.set_result(result)
        self.timings.append(StepTiming(self._count, binding.rung.index, start - last_end, start - t_wait, start, end))
        self._count += 1
        return end
