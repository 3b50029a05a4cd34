"""How an ``agentserve`` command ends when a signal stops it short: exit status 128 + the signal's number, the
shell's convention (130 for Ctrl-C).  ``up`` exits so when a signal forces its clean-up; every other command when a
Ctrl-C interrupts its work (one line on stderr instead of click's ``Aborted!`` and exit status 1)."""

from __future__ import annotations

import signal
import sys
from typing import Any, NoReturn

import click


def signal_exit_status(signum: int) -> int:
    return 128 + signum


class Terminated(KeyboardInterrupt):
    """A SIGTERM, raised where a Ctrl-C would be so that the same clean-up runs (:func:`interrupt_on_sigterm`)."""

    signum = signal.SIGTERM


def interrupt_on_sigterm() -> Any:
    """From now on in this (main) thread, SIGTERM interrupts as Ctrl-C does: ``finally`` blocks and context managers
    run (servers stopped, temporary folders removed) instead of the process dying where it stands.  Returns the
    handler it replaced (to put back)."""

    def terminate(signum: int, frame: object) -> None:
        raise Terminated

    return signal.signal(signal.SIGTERM, terminate)


def exit_interrupted(command: str | None, error: KeyboardInterrupt | None = None) -> NoReturn:
    """The end of a command that a Ctrl-C (``KeyboardInterrupt``), or a SIGTERM it handles so, interrupted."""
    signum = getattr(error, "signum", signal.SIGINT)
    newline = "\n" if sys.stderr.isatty() and signum == signal.SIGINT else ""  # past the terminal's ^C
    what = "interrupted" if signum == signal.SIGINT else "terminated"
    click.echo(f"{newline}agentserve{f' {command}' if command else ''}: {what}", err=True)
    sys.exit(signal_exit_status(signum))
