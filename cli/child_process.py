"""Children that only their parent stops: each runs in its own session, so a Ctrl-C or a closed terminal reaches
the parent alone, which stops them in order; on Linux each also gets SIGTERM if the parent dies without doing so
(SIGKILL, an unhandled SIGHUP).  That signal comes when the *thread* that started the child ends: start them from
the main thread."""

from __future__ import annotations

import contextlib
import ctypes
import signal
import sys
from typing import Any

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def own_session() -> dict[str, Any]:
    """The ``subprocess.Popen`` arguments that make such a child."""
    return {"start_new_session": True, "preexec_fn": _die_with_parent if sys.platform == "linux" else None}
