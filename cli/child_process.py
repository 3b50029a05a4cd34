"""Children that only their parent stops: each runs in its own session, so a Ctrl-C or a closed terminal reaches
the parent alone, which stops them in order; on Linux each also gets SIGTERM if the parent dies without doing so
(SIGKILL, an unhandled SIGHUP).  That signal comes when the *thread* that started the child ends: start them from
the main thread."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import sys
from typing import Any

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:  # pragma: no cover - runs in the child between fork and exec
    """Ask for SIGTERM at ``parent``'s death; if it already died (between the fork and this call, when no signal
    will come) end here, before the exec: a fleet SIGKILLed while starting a worker left that worker serving."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        os._exit(1)


def own_session() -> dict[str, Any]:
    """The ``subprocess.Popen`` arguments that make such a child (of this process)."""
    linux = sys.platform == "linux"
    return {"start_new_session": True, "preexec_fn": functools.partial(die_with_parent, os.getpid()) if linux else None}
