"""The interface between the replayer and a system under test.

A :class:`Driver` opens one :class:`DriverSession` per agent task. A session is *stateful* from the
replayer's point of view: each :meth:`DriverSession.turn` passes only the tokens that turn appends
(the cold prompt, then each tool output); a driver for a stateless server keeps the conversation
itself and resends it. ``turn`` yields ``(token_ids, t)`` for every chunk of output tokens as it
arrives, ``t`` being ``time.perf_counter()`` at arrival on the client.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

Chunk = tuple[list[int], float]


class DriverSession(Protocol):
    def turn(self, prompt_ids: Sequence[int], max_tokens: int) -> AsyncIterator[Chunk]:
        """Append ``prompt_ids``, decode exactly ``max_tokens`` tokens (ignore EOS), stream them."""
        ...

    async def close(self) -> None:
        """End the conversation (a stateful server may free its KV now)."""
        ...


class Driver(Protocol):
    name: str

    async def open_session(self) -> DriverSession: ...

    async def aclose(self) -> None: ...
