"""How ``agentserve up`` answers SIGINT, SIGTERM and SIGHUP (a closed terminal or a dropped ssh session: a stop
like SIGTERM's, not a death without the clean-up).

The first one stops it (while loading: the load is interrupted; while serving: the loop ends its turns and
returns) and the clean-up runs: the gateway and the executor are asked to stop and given a grace (seconds, more
for an executor that does not answer), then the shared memory and the socket are removed.  A second one (while the
loop ends its turns or during the clean-up) forces it (so does the first, when the clean-up follows an error):
SIGKILL to the executor and the gateway, the run's segments and ipc socket removed all the same, exit code 128 +
the signal's number (130 for a second Ctrl-C); signals during the forced stop are ignored.  Once the clean-up is
done, signals are ignored until the exit.

A hangup never forces: a closed terminal sends SIGHUP more than once (the shell passes it on to its jobs, then
the kernel sends it to the foreground group), so the later ones are ignored and the clean-up runs to its end.  A
process started with SIGHUP ignored (``nohup agentserve up &``) keeps ignoring it: it was asked to outlive the
terminal.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from agentserve.cli.interrupts import signal_exit_status
from agentserve.shm.segment import run_cleanups

log = logging.getLogger("agentserve.up")

FORCING = (signal.SIGINT, signal.SIGTERM)  # the signals a second stop is asked by
HANGUP_IGNORED = signal.getsignal(signal.SIGHUP) == signal.SIG_IGN  # as inherited (nohup): read before any handler
SIGNALS = FORCING if HANGUP_IGNORED else (*FORCING, signal.SIGHUP)


class ForcedStop:
    """The handler of a signal during the clean-up: kill ``children()``, remove what the run made, exit."""

    def __init__(self, children: Callable[[], Iterable[subprocess.Popen | None]], socket: Path | None) -> None:
        self._children = children
        self._socket = socket

    def __call__(self, signum: int, frame: object) -> None:
        ignore_signals()  # a third one must not run this again: it would find the names taken and exit before them
        try:
            log.warning("received %s during the clean-up; forcing it: killing the executor and the gateway",
                        signal.Signals(signum).name)
            for proc in self._children():
                if proc is not None and proc.poll() is None:
                    proc.kill()
            run_cleanups()  # every segment and semaphore of the run: this process made them all
            if self._socket is not None:
                self._socket.unlink(missing_ok=True)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:  # whatever raised above (a closed stderr, a child gone): the exit is what was asked for
            os._exit(signal_exit_status(signum))

    def arm(self) -> None:
        """From now on SIGINT or SIGTERM forces the clean-up; a hangup changes nothing."""
        for sig in SIGNALS:
            signal.signal(sig, self if sig in FORCING else signal.SIG_IGN)


class HeldSignals:
    """Handler from the socket's bind until :func:`on_signals`: notes the first stop signal, acts on none.

    Between binding the socket and installing the real handlers a SIGTERM (a fleet's parent-death signal, a quick
    Ctrl-C) killed ``up`` by default action and left the socket.  (Blocking the signals instead does not do: the
    kernel hands a process's signal to any thread not blocking it, and imports start threads.)"""

    def __init__(self) -> None:
        self.got: int | None = None

    def __call__(self, signum: int, frame: object) -> None:
        self.got = self.got or signum


def hold_signals() -> HeldSignals:
    held = HeldSignals()
    for sig in SIGNALS:
        signal.signal(sig, held)
    return held


def on_signals(stop: Callable[[], None], forced: ForcedStop, held: HeldSignals | None = None) -> None:
    """The first signal calls ``stop`` (the clean-up follows); any later one is ``forced``.  A signal ``held``
    noted before is acted on now, as the first."""

    def handler(signum: int, frame: object) -> None:
        log.info("received %s; stopping", signal.Signals(signum).name)
        forced.arm()
        stop()

    for sig in SIGNALS:
        signal.signal(sig, handler)
    if held is not None and held.got is not None:
        handler(held.got, None)


def ignore_signals() -> None:
    """SIG_IGN, not a Python handler: Python puts its own handlers back to the default as it exits, so a late
    signal would still kill the process with a signal's exit code after a clean stop."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def interrupt() -> None:
    """``stop`` while the model loads: unwind the start through its ``finally`` clauses."""
    raise KeyboardInterrupt
