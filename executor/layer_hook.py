"""A callback a lane thread runs between the layers of its forward passes.

On CPU cores a lane sets one for each step: it runs a *preempting* step (a resume sent ahead of the cold
chunk in flight, :attr:`~agentserve.protocol.ring_messages.Plan.preempt`) at the next layer boundary of the
chunk, inside it (:meth:`~agentserve.executor.lanes.LaneWorker.run_preempting`).  Thread-local, so another lane's
forward never sees it; with none set the hook costs one attribute lookup per layer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_local = threading.local()


def between_layers() -> None:
    """Run this thread's callback, if one is set (the model calls this between its layers)."""
    fn = getattr(_local, "fn", None)
    if fn is not None:
        fn()


@contextmanager
def layer_callback(fn: Callable[[], None] | None) -> Iterator[None]:
    """Set this thread's callback for the duration of the block (restoring the one before it)."""
    before = getattr(_local, "fn", None)
    _local.fn = fn
    try:
        yield
    finally:
        _local.fn = before
