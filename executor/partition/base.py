"""The partition-backend interface every backend (green-ctx, cuda-streams, cpu-cores) implements.

Invariants:
- ``ladder`` is fixed at construction but for ``drop_rungs`` before the executor is ready; rung ``i`` is
  ``ladder[i]`` and the last rung is unpartitioned.
- ``lane_context(lane, rung)`` is entered *on the lane's own thread* and binds that thread's work to
  the lane's share of the rung (a CUDA stream, or CPU cores + intra-op threads) until it exits.
- ``close()`` never releases a stream while a lane is inside ``lane_context``: it waits for every
  lease to end (or raises :class:`PartitionBusy`), then releases streams before contexts.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Collection, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from agentserve.protocol.lanes import Lane, Rung

if TYPE_CHECKING:
    from agentserve.executor.fused.helper import DecodeHelper


class BackendUnavailable(RuntimeError):
    """This backend cannot run here; the message is the reason detection records."""


class PartitionBusy(RuntimeError):
    """``close()`` timed out while a lane still held a binding."""


@dataclass(frozen=True)
class LaneBinding:
    """What a lane thread runs on while bound: ``units`` SMs or cores of ``rung``."""

    lane: Lane
    rung: Rung
    units: int
    stream: Any = None  # torch.cuda.Stream on a GPU backend, None on CPU
    threads: int = 0  # intra-op threads of the lane thread (CPU backend)
    cores: tuple[int, ...] = field(default=())
    idle: bool = False  # the lane thread runs at idle OS priority (CPU prefill on the shared rung)


class LeaseGuard:
    """Counts bindings in use; ``drain`` refuses new ones and waits until none is left."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held: Counter[tuple[Lane, int]] = Counter()
        self._closing = False

    @contextmanager
    def lease(self, key: tuple[Lane, int]) -> Iterator[None]:
        with self._cond:
            if self._closing:
                raise RuntimeError("partition backend is closing or closed")
            self._held[key] += 1
        try:
            yield
        finally:
            with self._cond:
                self._held[key] -= 1
                if self._held[key] == 0:
                    del self._held[key]
                self._cond.notify_all()

    def in_use(self) -> dict[tuple[Lane, int], int]:
        with self._cond:
            return dict(self._held)

    def drain(self, timeout: float) -> None:
        with self._cond:
            self._closing = True
            if not self._cond.wait_for(lambda: not self._held, timeout=timeout):
                self._closing = False
                raise PartitionBusy(f"lanes still bound after {timeout}s: {dict(self._held)}")


class PartitionBackend(ABC):
    """One way of splitting the hardware between the decode and the prefill lane."""

    name: str = ""
    unit: str = ""  # "SMs" or "cores"

    def __init__(self, ladder: list[Rung], device: str, reason: str) -> None:
        self.ladder = ladder
        self.device = device
        self.reason = reason
        self._guard = LeaseGuard()
        self._closed = False

    @property
    def partitioned(self) -> bool:
        return any(r.partitioned for r in self.ladder)

    def rung(self, index: int) -> Rung:
        if not 0 <= index < len(self.ladder):
            raise IndexError(f"rung {index} not in ladder of {len(self.ladder)}")
        return self.ladder[index]

    @contextmanager
    def lane_context(self, lane: Lane, rung: int) -> Iterator[LaneBinding]:
        """Bind the calling thread's work to ``lane``'s share of ``rung`` (enter on the lane thread)."""
        r = self.rung(rung)
        with self._guard.lease((Lane(lane), r.index)), self._bind(Lane(lane), r) as binding:
            yield binding

    def step_scope(
        self, binding: LaneBinding, num_tokens: int, hold_cores: bool = False, decode_idle: bool = False
    ) -> AbstractContextManager[DecodeHelper | None]:
        """Settings for one step of ``num_tokens`` tokens inside ``binding`` (enter on the lane thread).

        None by default; the CPU backend picks the step's intra-op thread count and lends decode's idle cores to
        a shared-rung prefill step (``hold_cores``: ``Plan.hold_cores``, decode's cores to the step's end;
        ``decode_idle``: ``Plan.decode_idle``, lent from its start).  The context yields the decode helper the step
        may use (:meth:`attach_decode_helper`), else ``None``."""
        return nullcontext()

    def attach_decode_helper(self, helper: DecodeHelper) -> bool:
        """Start ``helper`` (:mod:`~agentserve.executor.fused.helper`) for the decode lane's one-thread steps where
        this backend has a core for it; whether it did (the caller then closes it after the lanes stop)."""
        return False

    def between_layers(self, binding: LaneBinding) -> None:
        """Called on the lane thread between the layers of a step inside ``binding`` (CPU cores only).

        Nothing by default; the CPU backend lets a shared-rung prefill step widen onto decode's idle cores
        and give them back here."""
        return None

    def in_use(self) -> dict[tuple[Lane, int], int]:
        return self._guard.in_use()

    def drop_rungs(self, indices: Collection[int], why: str) -> None:
        """Take the partitioned rungs ``indices`` out of the ladder, renumbering the rest in order (rung ``i``
        stays ``ladder[i]``); ``why`` joins the reason.  For rungs that cannot run (their warm-up failed):
        call it before ``Ready`` and rebind every lane afterwards, since a lane's binding names its old index.

        Raises ValueError for the top rung, a rung not in the ladder, or a rung a lane is bound to."""
        gone = set(indices)
        if not gone <= {r.index for r in self.ladder[:-1]}:
            raise ValueError(f"rungs {sorted(gone)}: only partitioned rungs below the top can be dropped")
        bound = sorted({rung for _, rung in self.in_use()} & gone)
        if bound:
            raise ValueError(f"rungs {bound} are in use by a lane")
        kept = [r for r in self.ladder if r.index not in gone]
        renumber = {r.index: i for i, r in enumerate(kept)}
        self._renumber(renumber)
        self.ladder = [msgspec.structs.replace(r, index=renumber[r.index]) for r in kept]
        self.reason = f"{why}; {self.reason}" if self.reason else why  # first: `top` cuts a long reason short

    def _renumber(self, new_index: dict[int, int]) -> None:
        """Re-key per-rung state by ``new_index`` (old index -> new, kept rungs only)."""
        raise NotImplementedError(f"the {self.name} backend cannot drop rungs")

    def close(self, timeout: float = 10.0) -> None:
        """Wait until no lane is bound, then release streams, then contexts. Idempotent."""
        if self._closed:
            return
        self._guard.drain(timeout)
        self._closed = True
        self._release()

    def describe(self) -> dict[str, Any]:
        """A JSON-ready summary (``agentserve doctor``)."""
        return {
            "backend": self.name,
            "partitioned": self.partitioned,
            "reason": self.reason,
            "device": self.device,
            "unit": self.unit,
            "ladder": [
                {
                    "rung": r.index,
                    "decode": r.decode_units,
                    "prefill": r.prefill_units,
                    "partitioned": r.partitioned,
                }
                for r in self.ladder
            ],
        }

    def __enter__(self) -> PartitionBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @abstractmethod
    def _bind(self, lane: Lane, rung: Rung) -> AbstractContextManager[LaneBinding]: ...

    @abstractmethod
    def _release(self) -> None: ...
