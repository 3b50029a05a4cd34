"""Driver for AgentServe itself, through the asyncio client SDK in raw-token mode.

AgentServe keeps each session's KV across turns, so a turn sends only the tokens it appends
(``token_ids``) and decodes ``max_tokens`` with ``ignore_eos``; tool-call parsing is off (the
benchmark's tokens are random). One client connection carries every agent's session.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Sequence

from agentserve.bench.driver import Chunk


class SDKSession:
    def __init__(self, session) -> None:  # an agentserve.client.AsyncSession
        self.session = session

    async def turn(self, prompt_ids: Sequence[int], max_tokens: int) -> AsyncIterator[Chunk]:
        from agentserve.client import TokenIds

        stream = self.session.turn(token_ids=list(prompt_ids), max_tokens=max_tokens, ignore_eos=True,
                                   temperature=0.0)
        async for event in stream:
            if isinstance(event, TokenIds) and event.token_ids:
                yield list(event.token_ids), time.perf_counter()

    async def close(self) -> None:
        from agentserve.client import AgentServeError

        with contextlib.suppress(AgentServeError):  # e.g. the run cancelled: closing is no result of the system
            await self.session.close()


class SDKDriver:
    """``endpoint`` as ``agentserve up`` prints it (``ipc://…`` or ``tcp://…``)."""

    def __init__(self, endpoint: str, *, name: str = "agentserve", system: str | None = None) -> None:
        self.endpoint = endpoint
        self.name = name
        self.system = system
        self._client = None

    async def connect(self) -> SDKDriver:
        from agentserve.client import AsyncAgentClient

        self._client = await AsyncAgentClient(self.endpoint, name="agentserve-bench").connect()
        return self

    async def open_session(self) -> SDKSession:
        if self._client is None:
            await self.connect()
        return SDKSession(await self._client.session(system=self.system, parse_tool_calls=False))

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None
