"""One choice of a chat completion: a turn on an orchestrator session, its output as OpenAI deltas.

The session is the one the conversation map holds for this conversation (only the new messages are
sent: a resume) or a new one (the whole conversation: a cold prefill).  After a complete turn the
session is filed under the conversation including this reply; a failed or abandoned turn closes it,
which frees its KV at once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from agentserve.client import AgentServeError, Done, ExecutorFailed, ServerBusy, TextDelta, TokenIds, UnknownSession
from agentserve.gateway.backend import Backend
from agentserve.gateway.chat_plan import ChatPlan
from agentserve.gateway.errors import from_client_error
from agentserve.gateway.logprobs import LogprobLog
from agentserve.gateway.messages import Canonical, canonical_args
from agentserve.gateway.reply_stream import Delta, ReplyStreamer
from agentserve.gateway.turn_timer import TurnTimer, count_abandoned
from agentserve.protocol.client_messages import FinishReason


class ChoiceRun:
    def __init__(self, backend: Backend, plan: ChatPlan, index: int) -> None:
        self.backend = backend
        self.plan = plan
        self.index = index
        self.streamer = ReplyStreamer(plan.tool_format, plan.max_calls)
        self.logprobs = LogprobLog(backend.require()[2]) if plan.logprobs else None
        self.session: Any = None
        self.resumed = False
        self.done: Done | None = None
        self.timer = TurnTimer()
        self._events: AsyncIterator[Any] | None = None
        self._first: Any = None

    async def start(self) -> None:
        """Send the turn and wait for its first event, so a refused turn is an HTTP error, not a stream."""
        digests = self.plan.digests() if self.index == 0 else []  # choices past the first start fresh sessions
        taken = self.backend.conversations.take(digests) if digests else None
        if taken is not None:
            try:
                await self._send(taken[0], self.plan.messages_after(taken[1]), filed_under=digests[taken[1] - 1])
                self.resumed = True
                return
            except UnknownSession:
                pass  # the orchestrator dropped it: start over with the whole conversation
        t = self.plan.translated
        await self._send(await self._open(t.system), t.messages)

    async def _open(self, system: str | None) -> Any:
        try:
            return await self.backend.open_session(system, self.plan.tools)
        except AgentServeError as e:
            raise from_client_error(e) from None

    async def _send(self, session: Any, messages: list[Any], filed_under: bytes | None = None) -> None:
        """Start the turn on ``session`` (one the conversation map held under ``filed_under``, if given)."""
        self.session = session
        self._events = session.turn(messages, **self.plan.choice_options(self.index)).__aiter__()
        try:
            self._first = await self._events.__anext__()
        except UnknownSession:
            raise
        except AgentServeError as e:
            self.session = None
            if filed_under is not None and isinstance(e, ServerBusy | ExecutorFailed):
                self.backend.conversations.file(filed_under, session)  # refused for now: the retry continues it
            else:
                self.backend.close_later(session)
            raise from_client_error(e) from None

    async def deltas(self) -> AsyncIterator[Delta]:
        """The reply's deltas until the turn is done; raises APIError if the turn fails on the way."""
        assert self._events is not None
        event, self._first = self._first, None
        try:
            while True:
                for delta in self._on(event):
                    yield delta
                if self.done is not None:
                    break
                event = await self._events.__anext__()
        except AgentServeError as e:
            self.abandon()
            raise from_client_error(e) from None
        for delta in self.streamer.finish():
            yield delta
        self._observe()
        self._file()

    def _observe(self) -> None:
        reason = "abort" if self.done is not None and self.done.finish == FinishReason.ABORT else self.finish_reason
        self.timer.observe(self.backend.metrics, self.done, self.resumed, reason)

    def _on(self, event: Any) -> list[Delta]:
        if isinstance(event, TokenIds):
            self.timer.on_tokens(event)
            if self.logprobs is not None:
                self.logprobs.add(event)
        elif isinstance(event, TextDelta):
            return self.streamer.feed(event.text)
        elif isinstance(event, Done):
            self.done = event
        return []

    @property
    def finish_reason(self) -> str:
        """``length`` when max_tokens cut the reply; ``tool_calls`` when it ended with its calls complete; else
        ``stop`` (a stop string or the end of text, even inside a call: its arguments are then as far as written)."""
        finish = self.done.finish if self.done else FinishReason.ABORT
        if finish == FinishReason.LENGTH:
            return "length"
        return "tool_calls" if self.streamer.calls and not self.streamer.unfinished else "stop"

    def reply(self) -> Canonical:
        """The assistant message as a client sends it back next turn."""
        calls = tuple((c.id, c.name, canonical_args(c.arguments)) for c in self.streamer.calls)
        return Canonical("assistant", self.streamer.content, tool_calls=calls)

    def _file(self) -> None:
        session, self.session = self.session, None
        if session is None:
            return
        if self.done is None or self.done.finish == FinishReason.ABORT or self.streamer.dropped:
            self.backend.close_later(session)  # dropped calls: its context holds what the answer left out
            return
        self.backend.conversations.file(self.plan.digests([self.reply()])[-1], session)

    def abandon(self, count: bool = True) -> None:
        """The client went away or the turn failed: close the session (aborts a running turn, frees KV); ``count``
        it as an ``abort`` in the request metrics unless the request was refused (another choice of it failed to
        start: nothing of it was answered)."""
        session, self.session = self.session, None
        if count:
            count_abandoned(self.backend.metrics, session)
        if session is not None:
            self.backend.close_later(session)

    def logprobs_object(self, final: bool) -> dict[str, Any] | None:
        """The choice's ``logprobs`` of the tokens not listed yet that start in the text sent so far; ``final``:
        the reply is done (a whole answer's lists them all), so those at its end (an eos) are listed too, unless a
        stop string cut the text there (those it cut off are never listed)."""
        if self.logprobs is None:
            return None
        return self.logprobs.take_chat(self.streamer.sent_chars, final)

    def message(self) -> dict[str, Any]:
        """The non-streamed ``message`` of this choice."""
        out: dict[str, Any] = {"role": "assistant", "content": self.streamer.content_or_none}
        if self.streamer.calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.streamer.calls
            ]
        return out
