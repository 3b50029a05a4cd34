"""The gateway's side of the orchestrator: one SDK connection, what the server said about itself, the
tokenizer of its checkpoint (torch-free), and the conversation map's sessions.

The connection is made in the background (the orchestrator may still be loading its model when the
gateway starts); until it stands, every endpoint but ``/health`` and ``/metrics`` answers 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from agentserve.client import AgentServeError, AsyncAgentClient, AsyncSession, LimitExceeded, ServerBusy
from agentserve.gateway.conversations import ConversationMap
from agentserve.gateway.errors import APIError, not_found, unavailable
from agentserve.gateway.metrics import Metrics
from agentserve.gateway.token_conversations import TokenConversationMap
from agentserve.gateway.tokenizing import TokenizingLanes
from agentserve.orchestrator.text.tokenization import Tokenizer
from agentserve.protocol.client_messages import Welcome
from agentserve.protocol.limits import SESSION_LIMIT, Limits
from agentserve.protocol.stats import Snapshot, decode_snapshot

log = logging.getLogger("agentserve.gateway")


CLOSE_WAIT_S = 5.0  # how long an open at the session bound waits for closes under way


@dataclass
class GatewayOptions:
    endpoint: str
    served_model_name: str = ""  # the name clients send as `model` (default: the checkpoint's folder)
    api_key: str = ""
    max_body_bytes: int = 8 * 2**20
    max_n: int = 16
    # limits.toml's [clients] bounds of the same names, which `up` passes (a test keeps these defaults equal to them)
    tokenize_inline_bytes: int = 65536  # a larger body tokenises on a thread of its own
    max_tokenizing_bytes: int = 64 * 2**20  # bodies waiting for that thread; more: 503 busy
    conversation_capacity: int = 4096
    conversation_idle_s: float = 600.0
    metrics_compat: tuple[str, ...] = ()  # "vllm": also emit every vLLM metric under `vllm:`


class Backend:
    def __init__(self, options: GatewayOptions) -> None:
        self.options = options
        self.client: AsyncAgentClient | None = None
        self.welcome: Welcome | None = None
        self.tokenizer: Tokenizer | None = None
        self.limits = Limits()  # the server's request limits, once its Welcome says them
        self.tokenizing = TokenizingLanes(options.tokenize_inline_bytes, options.max_tokenizing_bytes)
        self.metrics: Metrics | None = None
        self.conversations = ConversationMap(options.conversation_capacity, options.conversation_idle_s,
                                             on_evict=self.close_later)
        self.token_conversations = TokenConversationMap(options.conversation_capacity, options.conversation_idle_s,
                                                        on_evict=self.close_later)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._connector: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._connector = asyncio.create_task(self._connect())
        self._sweeper = asyncio.create_task(self._sweep())

    async def _sweep(self, every_s: float = 5.0) -> None:
        """Close the sessions of conversations nobody continued within ``conversation_idle_s``."""
        while True:
            await asyncio.sleep(every_s)
            self.conversations.sweep()
            self.token_conversations.sweep()

    async def _connect(self) -> None:
        while True:
            client = AsyncAgentClient(self.options.endpoint, timeout=5.0, name="agentserve-gateway")
            try:
                await client.connect()
            except AgentServeError as e:
                log.info("waiting for the orchestrator at %s: %s", self.options.endpoint, e)
                await asyncio.sleep(0.5)
                continue
            welcome = client.server
            assert welcome is not None
            self.tokenizer = await asyncio.to_thread(Tokenizer.from_dir, welcome.model)
            self.limits = Limits.announced(welcome.limits)
            self.welcome = welcome
            self.metrics = Metrics(self.model_name, welcome.max_model_len, self.options.metrics_compat)
            self.client = client
            log.info("connected to the orchestrator at %s (model %s)", self.options.endpoint, welcome.model)
            return

    async def stop(self) -> None:
        for task in (self._connector, self._sweeper):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self.tokenizing.close()
        if self.client is not None:
            for session in [*self.conversations.drain(), *self.token_conversations.drain()]:
                self.close_later(session)
            if self._tasks:
                await asyncio.wait(list(self._tasks), timeout=2.0)
            await self.client.close()
            self.client = None

    def require(self) -> tuple[AsyncAgentClient, Welcome, Tokenizer]:
        if self.client is None or self.welcome is None or self.tokenizer is None:
            raise unavailable("the gateway is still connecting to the orchestrator; retry shortly")
        return self.client, self.welcome, self.tokenizer

    # ---- what requests need ------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        if self.options.served_model_name:
            return self.options.served_model_name
        return self.welcome.model.rstrip("/").rsplit("/", 1)[-1] if self.welcome else ""

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary as the executor loaded it (often padded past the tokenizer's): ids a prompt may
        hold; the tokenizer's size from a server that does not say."""
        if self.welcome is not None and self.welcome.vocab_size > 0:
            return self.welcome.vocab_size
        return self.tokenizer.vocab_size if self.tokenizer is not None else 0

    def check_model(self, model: str | None) -> None:
        """``model`` may be omitted, the served name, or the checkpoint path; anything else is a 404."""
        if model is None or model == self.model_name or (self.welcome and model == self.welcome.model):
            return
        raise not_found(f"the model `{model}` does not exist (this server serves `{self.model_name}`)",
                        param="model")

    async def stats(self, timeout: float = 2.0) -> Snapshot:
        client, _, _ = self.require()
        data = await asyncio.wait_for(client.stats(), timeout)
        return decode_snapshot(data)

    async def open_session(self, system: str | None = None, tools: list[dict[str, Any]] | None = None,
                           name: str = "http", parse_tool_calls: bool = True) -> AsyncSession:
        """A new session (closed if the request is cancelled meanwhile).  Where the orchestrator refuses it
        because this connection holds its limit of sessions, the conversation filed longest ago is closed and the
        open retried; with none filed (every session is a request in flight) the answer is ``busy``.  Closes
        already under way in the background (evictions, abandoned streams) are awaited first: each frees a session
        without giving up a filed conversation."""
        client, _, _ = self.require()
        while True:
            try:
                return await client.session(system=system, tools=tools or None, name=name,
                                            parse_tool_calls=parse_tool_calls)
            except LimitExceeded as e:
                if SESSION_LIMIT not in e.message:
                    raise
                if self._tasks and (await asyncio.wait(list(self._tasks), timeout=CLOSE_WAIT_S,
                                                      return_when=asyncio.FIRST_COMPLETED))[0]:
                    continue
                idle = self._pop_idlest()
                if idle is None:
                    raise ServerBusy(f"{e.message}, every one a request in flight; retry shortly") from None
                await self._close(idle)  # before the retry: the orchestrator handles a connection's requests in order

    def _pop_idlest(self) -> AsyncSession | None:
        """The session filed longest ago in either conversation map (it leaves its map); None if both are empty."""
        maps = [m for m in (self.conversations, self.token_conversations) if len(m)]
        return min(maps, key=lambda m: m.oldest_filed_at()).pop_oldest() if maps else None

    def close_later(self, session: AsyncSession) -> None:
        """Close ``session`` in the background (frees its KV); errors are only logged."""
        task = asyncio.get_running_loop().create_task(self._close(session))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _close(session: AsyncSession) -> None:
        try:
            await session.close()
        except (AgentServeError, APIError) as e:
            log.debug("closing session %d: %s", session.id, e)
