"""The decode lane's cores, lent to the prefill lane while decode has nothing to run (CPU cores backend).

On the shared (top) rung the prefill lane may use every core; while the decode lane holds a partitioned
rung, the cores of decode's partition are only *lent* to it:

- the prefill lane, at the start of each step and between its layers, runs on every core while decode is
  idle — no decode step running and none ended within ``widen_after_s``, or none since a step the scheduler
  planned with nothing decoding began (``Plan.decode_idle``: the last one ended its burst,
  :meth:`CoreLoan.burst_ended`) — and on its own cores otherwise (:meth:`CoreLoan.try_borrow` /
  :meth:`CoreLoan.give_back`);
- a decode step, before it runs, asks for its cores back and waits until the prefill lane has returned
  them — at its next layer boundary or the end of its step — for at most ``return_timeout_s``
  (:meth:`CoreLoan.decode_step`);
- a step the scheduler marks (``Plan.hold_cores``: a short step of resumes only) takes them once the decode step
  running now ends, whether decode is idle or not, and keeps them to its end; decode's next step waits for it
  (:meth:`CoreLoan.hold`, at most ``hold_timeout_s``).  A resume then runs on every core as under fcfs (1.7-1.9x
  faster than on one), for one pause of decode of about its length.

So decode never shares its cores with prefill work (on more than two cores the prefill lane's OpenMP
workers move with it where :mod:`.omp_team` can re-pin them); it waits at most one prefill layer, once per
burst of decode steps, while a cold chunk or a resume runs on every core for as long as decode leaves them,
where a fixed split would leave decode's core idle between its bursts.  Invariant: ``lent`` is true only while the
prefill lane runs on decode's cores, and it is set under the lock together with the check that decode is
idle, so a decode step that starts after the check waits for the next layer boundary instead of racing it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

WIDEN_AFTER_IDLE_S = 0.01  # decode steps of a burst follow each other within ~1 ms; a pause this long ends it
RETURN_TIMEOUT_S = 0.1  # a prefill layer on two cores takes ~5-25 ms; past this decode runs anyway
HOLD_TIMEOUT_S = 1.0  # a held step (resumes of up to 128 tokens by default) takes ~20-50 ms on two cores


class CoreLoan:
    """Who holds the decode lane's cores; shared by the two lane threads of one backend."""

    def __init__(
        self,
        widen_after_s: float = WIDEN_AFTER_IDLE_S,
        return_timeout_s: float = RETURN_TIMEOUT_S,
        hold_timeout_s: float = HOLD_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.widen_after_s = widen_after_s
        self.return_timeout_s = return_timeout_s
        self.hold_timeout_s = hold_timeout_s
        self._clock = clock
        self._cond = threading.Condition()
        self._decoding = 0  # decode steps waiting for their cores or running (0 or 1: one decode lane)
        self._decode_ended = float("-inf")
        self._lent = False
        self._holds = 0  # prefill steps that keep decode's cores for their whole length (decode waits them out)
        self._running = False  # a decode step is running (not merely waiting for its cores)
        self.borrows = 0  # times the prefill lane widened onto decode's cores
        self.holds = 0  # prefill steps that kept them to their end
        self.late_returns = 0  # decode steps that gave up waiting after return_timeout_s
        self.waits = 0  # decode steps that found their cores lent and waited for them
        self.wait_s = 0.0  # the time those steps waited, in all

    @property
    def lent(self) -> bool:
        return self._lent

    def try_borrow(self) -> bool:
        """Prefill lane: take decode's cores if decode is idle; whether the prefill lane holds them now."""
        with self._cond:
            if not self._lent and self._idle():
                self._lent = True
                self.borrows += 1
            return self._lent

    def burst_ended(self) -> None:
        """Prefill lane, starting a step the scheduler planned with no sequence decoding (``Plan.decode_idle``): the
        decode step that ended last ended its burst, so decode's cores are free now, not ``widen_after_s`` after it
        (a cold prompt that starts a task arrives a few ms after its agent's last decode step)."""
        with self._cond:
            self._decode_ended = float("-inf")

    def _idle(self) -> bool:
        """No decode step running or waiting, and none ended within ``widen_after_s`` (call holding the lock)."""
        return self._decoding == 0 and self._clock() - self._decode_ended >= self.widen_after_s

    @property
    def held(self) -> bool:
        """A prefill step keeps decode's cores to its end (:meth:`hold`)."""
        return self._holds > 0

    def hold(self) -> None:
        """Prefill lane, before a step that keeps decode's cores to its end (a short resume): once the decode step
        running now (if any) has ended, the prefill lane holds them; decode's next steps wait until
        :meth:`end_hold` (each side waits at most ``hold_timeout_s``)."""
        with self._cond:
            self._holds += 1
            self._cond.wait_for(lambda: not self._running, timeout=self.hold_timeout_s)
            if not self._lent:
                self._lent = True
                self.borrows += 1
            self.holds += 1

    def end_hold(self) -> None:
        """Prefill lane, after that step (before it gives the cores back)."""
        with self._cond:
            self._holds -= 1
            self._cond.notify_all()

    def wanted_back(self) -> bool:
        """Prefill lane, holding the cores: decode has run or is waiting to (give them back now)."""
        with self._cond:
            return not self._idle()

    def reclaim(self) -> None:
        """Decode lane, rebinding onto cores a running prefill step holds: count them as lent until its refit."""
        with self._cond:
            self._lent = True

    def give_back(self) -> None:
        """Prefill lane: it no longer runs on decode's cores (call after narrowing)."""
        with self._cond:
            if self._lent:
                self._lent = False
                self._cond.notify_all()

    @contextmanager
    def decode_step(self) -> Iterator[bool]:
        """Decode lane, around one step: wait for the cores to come back; yield whether they did in time."""
        with self._cond:
            self._decoding += 1
            returned = True
            if self._lent or self._holds:
                asked = self._clock()
                timeout = self.hold_timeout_s if self._holds else self.return_timeout_s
                returned = self._cond.wait_for(lambda: not self._lent and not self._holds, timeout=timeout)
                self.waits += 1
                self.wait_s += self._clock() - asked
                if not returned:
                    self.late_returns += 1
            self._running = True
        try:
            yield returned
        finally:
            with self._cond:
                self._running = False
                self._decoding -= 1
                self._decode_ended = self._clock()
                self._cond.notify_all()
