"""How an ``agentserve`` command ends when a signal stops it short: exit status 128 + the signal's number, the
shell's convention (130 for Ctrl-C).  ``up`` exits so when a signal forces its clean-up; every other command when a
Ctrl-C interrupts its work (one line on stderr instead of click's ``Aborted!`` and exit status 1)."""

from __future__ import annotations

import signal
import sys
from typing import NoReturn

import click


def signal_exit_status(signum: int) -> int:
    return 128 + signum


def exit_interrupted(command: str | None) -> NoReturn:
    """The end of a command that a Ctrl-C (``KeyboardInterrupt``) interrupted."""
    newline = "\n" if sys.stderr.isatty() else ""  # past the terminal's ^C
    click.echo(f"{newline}agentserve{f' {command}' if command else ''}: interrupted", err=True)
    sys.exit(signal_exit_status(signal.SIGINT))
