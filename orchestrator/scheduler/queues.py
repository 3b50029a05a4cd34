"""The scheduler's request queues, one per class and state.

``waiting[phase]`` hold requests without blocks (FIFO; a preempted request goes back to the
front); ``prefilling[phase]`` hold admitted requests part-way through their prompt; ``decoding``
holds requests producing tokens.  Dicts keep insertion (admission) order and remove in O(1).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from agentserve.orchestrator.scheduler.request import Phase, ReqState, Request

PREFILL_PHASES = (Phase.COLD, Phase.RESUME)


def _by_arrival(r: Request) -> float:
    return r.arrival


def _by_priority(r: Request) -> tuple[int, float]:
    return (-r.priority, r.arrival)


class Queues:
    def __init__(self) -> None:
        self.waiting: dict[Phase, deque[Request]] = {p: deque() for p in PREFILL_PHASES}
        self.prefilling: dict[Phase, dict[int, Request]] = {p: {} for p in PREFILL_PHASES}
        self.decoding: dict[int, Request] = {}
        self.prioritised = 0  # decoding requests with a non-zero priority

    def push_waiting(self, req: Request, front: bool = False) -> None:
        req.state = ReqState.WAITING
        if front:
            self.waiting[req.phase].appendleft(req)
        else:
            self.waiting[req.phase].append(req)

    def admitted(self, req: Request) -> None:
        """``req`` (already out of its waiting queue) now holds blocks and prefills."""
        req.state = ReqState.PREFILL
        self.prefilling[req.phase][req.seq_id] = req

    def to_decode(self, req: Request) -> None:
        del self.prefilling[req.phase][req.seq_id]
        req.state, req.phase = ReqState.DECODE, Phase.DECODE
        self.decoding[req.seq_id] = req
        self.prioritised += req.priority != 0

    def remove(self, req: Request) -> None:
        """Take ``req`` out of whichever queue holds it."""
        if req.state is ReqState.WAITING:
            self.waiting[req.phase].remove(req)
        elif req.state is ReqState.PREFILL:
            del self.prefilling[req.phase][req.seq_id]
        elif req.state is ReqState.DECODE:
            del self.decoding[req.seq_id]
            self.prioritised -= req.priority != 0

    def decode_order(self, by_priority: bool) -> list[Request]:
        """Decoding requests in admission order, or highest priority first, then oldest."""
        reqs = list(self.decoding.values())
        if by_priority and self.prioritised:
            reqs.sort(key=_by_priority)
        return reqs

    def phase_order(self, phase: Phase) -> list[Request]:
        """Requests of one prefill class: those already prefilling, then the waiting ones."""
        return [*self.prefilling[phase].values(), *self.waiting[phase]]

    def fifo_order(self) -> list[Request]:
        """Every prefill of either class: admitted ones first, then waiting, each by arrival."""
        running = heapq.merge(*(self.prefilling[p].values() for p in PREFILL_PHASES), key=_by_arrival)
        waiting = heapq.merge(*(self.waiting[p] for p in PREFILL_PHASES), key=_by_arrival)
        return [*running, *waiting]

    def holders(self) -> Iterator[Request]:
        """Requests that hold blocks."""
        for p in PREFILL_PHASES:
            yield from self.prefilling[p].values()
        yield from self.decoding.values()

    def num_active(self) -> int:
        return sum(len(d) for d in self.prefilling.values()) + len(self.decoding)

    def head(self, phase: Phase) -> Request | None:
        """The request of ``phase`` served next (FIFO): the first admitted one, else the first waiting."""
        for req in self.prefilling[phase].values():
            return req
        waiting = self.waiting[phase]
        return waiting[0] if waiting else None

    def has_prefill_work(self) -> bool:
        return any(self.waiting[p] or self.prefilling[p] for p in PREFILL_PHASES)

    def counts(self) -> dict[str, int]:
        return {
            "cold_waiting": len(self.waiting[Phase.COLD]),
            "resume_waiting": len(self.waiting[Phase.RESUME]),
            "cold_prefilling": len(self.prefilling[Phase.COLD]),
            "resume_prefilling": len(self.prefilling[Phase.RESUME]),
            "decoding": len(self.decoding),
        }
