"""Request building shared by the sync and asyncio clients (no I/O here)."""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any, TypedDict

from agentserve.protocol.client_messages import (
    PROTOCOL_VERSION,
    Constraint,
    Message,
    OpenSession,
    SessionOptions,
    Turn,
)

MessageLike = Message | Mapping[str, Any]


class TurnOptions(TypedDict, total=False):
    """Keyword options of ``Session.turn`` (sync and asyncio): the :class:`Turn` fields."""

    token_ids: list[int]  # raw-token mode: appended with no chat template
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop: list[str]
    ignore_eos: bool
    constraint: Constraint | None  # grammar-constrained output (JSON schema, forced tool calls, or either)
    logprobs: bool  # each TokenIds event carries its tokens' logprobs
    top_logprobs: int  # ... and up to 20 most likely alternatives per token (needs logprobs)


def to_message(m: MessageLike) -> Message:
    """A :class:`Message` from itself or from an OpenAI-shaped dict (an assistant's ``tool_calls`` included, their
    ``arguments`` as an object: a JSON object's text is parsed, as chat templates render objects)."""
    if isinstance(m, Message):
        return m
    return Message(
        role=str(m["role"]),
        content=str(m.get("content") or ""),
        tool_call_id=str(m.get("tool_call_id", "")),
        name=str(m.get("name", "")),
        tool_calls=[_tool_call(c) for c in m.get("tool_calls") or ()],
    )


def _tool_call(call: Mapping[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    args = function.get("arguments")
    if isinstance(args, str):
        with contextlib.suppress(json.JSONDecodeError):
            parsed = json.loads(args) if args.strip() else {}
            function["arguments"] = parsed if isinstance(parsed, dict) else args
    return {**call, "function": function}


def open_request(
    req: int, system: str | None, tools: Iterable[Mapping[str, Any]] | None, name: str, parse_tool_calls: bool
) -> OpenSession:
    return OpenSession(
        req=req,
        version=PROTOCOL_VERSION,
        system=system,
        tools=[dict(t) for t in tools or ()],
        options=SessionOptions(name=name, parse_tool_calls=parse_tool_calls),
    )


class SessionState:
    """Client-side state of one session: its id and the tool results waiting for the next turn."""

    def __init__(self, session_id: int) -> None:
        self.id = session_id
        self.pending: list[Message] = []
        self.closed = False

    def tool_result(self, call_id: str, content: Any, name: str = "") -> None:
        text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False, default=str)
        self.pending.append(Message(role="tool", content=text, tool_call_id=call_id, name=name))

    def new_turn(
        self,
        req: int,
        messages: str | Iterable[MessageLike] | None = None,
        *,
        token_ids: Iterable[int] | None = None,
        stop: Iterable[str] | None = None,
        **sampling: Any,
    ) -> Turn:
        """A :class:`Turn` of ``messages`` (a str is a user message); the queued tool results go in at :meth:`carry`."""
        if isinstance(messages, str):
            msgs = [Message(role="user", content=messages)]
        else:
            msgs = [to_message(m) for m in messages or ()]
        return Turn(
            req=req,
            session=self.id,
            messages=msgs,
            token_ids=list(token_ids or ()),
            stop=list(stop or ()),
            **sampling,
        )

    def carry(self, turn: Turn) -> Callable[[], None]:
        """Move the queued tool results in front of ``turn``'s messages, as it is sent (a turn never sent takes
        none); returns what queues them again should that turn fail."""
        carried, self.pending = self.pending, []
        turn.messages = carried + turn.messages
        return partial(self.restore, carried)

    def restore(self, results: list[Message]) -> None:
        """A turn that carried ``results`` ended in an error (the server keeps no part of it): they wait again."""
        self.pending = results + self.pending


class ReqCounter:
    def __init__(self) -> None:
        self._it = itertools.count(1)

    def __call__(self) -> int:
        return next(self._it)
