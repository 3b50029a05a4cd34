"""A thread-safe queue the orchestrator loop can wait on with its ``zmq.Poller``.

Worker threads (the result-ring reader, the prompt worker) :meth:`WakeQueue.post` messages; each post
writes one byte to a pipe whose read end is :meth:`WakeQueue.fileno`, so the loop's single poll wakes
for them and for client frames alike.  :meth:`WakeQueue.drain` takes everything queued.
"""

from __future__ import annotations

import contextlib
import os
import queue


class WakeQueue:
    def __init__(self) -> None:
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)

    def post(self, item: object) -> None:
        self._items.put(item)
        with contextlib.suppress(BlockingIOError):  # a full pipe already holds a wake-up
            os.write(self._write_fd, b"\0")

    def fileno(self) -> int:
        """Readable while something may be queued."""
        return self._read_fd

    def drain(self) -> list[object]:
        with contextlib.suppress(BlockingIOError):
            os.read(self._read_fd, 65536)
        out = []
        while True:
            try:
                out.append(self._items.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        for fd in (self._read_fd, self._write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
