"""Where the gateway tokenises client text, off the event loop (megabytes take seconds).

Requests of up to ``inline_bytes`` of body tokenise on the default thread pool; larger ones on one worker thread of
their own, in order, so that a short prompt never queues behind megabytes of someone else's.  The bytes waiting for
that thread (running or queued, counted until the job ends even when its client left) are bounded by
``max_waiting_bytes``; a request past it is a 503 ``busy`` that the OpenAI SDKs retry (a request alone always fits).
The same two bounds as the orchestrator's own worker thread (``configs/limits.toml`` ``[clients]``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from agentserve.gateway.errors import busy

T = TypeVar("T")


class TokenizingLanes:
    def __init__(self, inline_bytes: int, max_waiting_bytes: int) -> None:
        self.inline_bytes, self.max_waiting_bytes = inline_bytes, max_waiting_bytes
        self.waiting = 0  # body bytes of the jobs given to the long lane that have not ended
        self._long = ThreadPoolExecutor(1, thread_name_prefix="tokenize-long")

    async def run(self, size: int, job: Callable[[], T]) -> T:
        """``job()``'s result, run on the lane a request of ``size`` body bytes takes."""
        if size <= self.inline_bytes:
            return await asyncio.to_thread(job)
        if self.waiting and self.waiting + size > self.max_waiting_bytes:
            raise busy(f"{self.waiting} bytes of requests are waiting to be tokenised; {size} more exceed the limit "
                       f"of {self.max_waiting_bytes} (limits.clients.max_tokenizing_bytes): retry shortly")
        loop = asyncio.get_running_loop()
        self.waiting += size
        future = self._long.submit(job)
        future.add_done_callback(lambda _: self._ended(loop, size))
        return await asyncio.wrap_future(future)

    def _ended(self, loop: asyncio.AbstractEventLoop, size: int) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: nothing is counted any more
            loop.call_soon_threadsafe(self._release, size)

    def _release(self, size: int) -> None:
        self.waiting -= size

    def close(self) -> None:
        self._long.shutdown(wait=False, cancel_futures=True)
