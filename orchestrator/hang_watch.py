"""Notice an executor that hangs (SIGSTOP, a deadlocked kernel) rather than dies.

A dead executor is seen by the result ring (``PeerDied``); a hung one is alive and silent.  The
watch counts plans in flight: when plans are outstanding and no result of any kind has landed for
longer than ``max(hang_floor_s, hang_step_multiple x the slowest of the last steps)``, the
executor counts as hung and the link kills it, which sends it down the restart path of a crashed one.
"""

from __future__ import annotations

from collections import deque

from agentserve.orchestrator.limits import HangRule
from agentserve.protocol.ring_messages import ExecError, Result

RECENT_STEPS = 64


class HangWatch:
    def __init__(self, rule: HangRule) -> None:
        self.rule = rule
        self.reset(0.0)

    def reset(self, now: float) -> None:
        """A fresh executor: nothing in flight, no step history."""
        self._in_flight: set[int] = set()
        self._last_progress = now
        self._durations: deque[float] = deque(maxlen=RECENT_STEPS)
        self._bound = self.rule.bound_s(0.0)  # kept as results land: every send and loop pass reads it

    def sent(self, step: int, now: float) -> None:
        if not self._in_flight:
            self._last_progress = now  # the clock starts when work starts
        self._in_flight.add(step)

    def landed(self, msg: Result | ExecError, now: float) -> None:
        self._in_flight.discard(msg.step)
        self._last_progress = now
        if isinstance(msg, Result):
            self._durations.append(max(0.0, msg.t_end - msg.t_start))
            self._bound = self.rule.bound_s(max(self._durations))

    def bound_s(self) -> float:
        return self._bound

    def hung(self, now: float) -> str | None:
        """Why the executor counts as hung, or None."""
        if not self._in_flight:
            return None
        silent = now - self._last_progress
        bound = self.bound_s()
        if silent <= bound:
            return None
        return (
            f"executor hung: {len(self._in_flight)} plan(s) in flight and no result for {silent:.1f} s "
            f"(bound {bound:.1f} s)"
        )
