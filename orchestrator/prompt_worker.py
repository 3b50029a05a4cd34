"""Prompt building (chat template + tokenisation) of large texts on one worker thread.

A 4 MiB message takes seconds to tokenise; done on the orchestrator loop it would freeze every
agent's token stream for that long.  The server hands such jobs here; the worker runs them in order
(the tokenizer releases the GIL while it encodes) and posts each outcome to a
:class:`~agentserve.orchestrator.wake_queue.WakeQueue` the loop's ``zmq.Poller`` waits on.  Jobs never
touch the server's state: the loop applies their results, first checking that the job still matters.
The worker counts the bytes of text each owner (a client) has in its jobs, so the loop can bound them.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentserve.orchestrator.wake_queue import WakeQueue


@dataclass(frozen=True)
class Done:
    key: Any
    result: Any = None
    error: Exception | None = None
    owner: bytes = b""
    size: int = 0


class PromptWorker:
    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done = WakeQueue()
        self.pending = 0
        self._held: dict[bytes, int] = {}  # owner → bytes of text in its jobs not yet drained
        self._thread = threading.Thread(target=self._run, name="prompt-worker", daemon=True)
        self._thread.start()

    def submit(self, key: Any, job: Callable[[], Any], owner: bytes = b"", size: int = 0) -> None:
        """Queue ``job``; ``size`` bytes of text count against ``owner`` (:meth:`held`) until it is drained."""
        self.pending += 1
        if size:
            self._held[owner] = self._held.get(owner, 0) + size
        self._jobs.put((key, job, owner, size))

    def held(self, owner: bytes) -> int:
        """Bytes of text in ``owner``'s jobs, queued, running or done but not drained."""
        return self._held.get(owner, 0)

    def fileno(self) -> int:
        """Readable when :meth:`drain` has something (for ``zmq.Poller``)."""
        return self._done.fileno()

    def drain(self) -> list[Done]:
        out: list[Done] = self._done.drain()  # type: ignore[assignment]
        self.pending -= len(out)
        for done in out:
            if done.size:
                left = self._held[done.owner] - done.size
                if left:
                    self._held[done.owner] = left
                else:
                    del self._held[done.owner]
        return out

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            key, job, owner, size = item
            try:
                done = Done(key, result=job(), owner=owner, size=size)
            except Exception as e:  # noqa: BLE001 - the loop turns it into the client's error
                done = Done(key, error=e, owner=owner, size=size)
            except BaseException as e:  # noqa: BLE001 - a tokenizer's panic (pyo3's PanicException): the same, as a
                # plain error, and this thread lives on for the next job
                done = Done(key, error=RuntimeError(f"{type(e).__name__}: {e}"), owner=owner, size=size)
            self._done.post(done)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5.0)
        self._done.close()
