"""Bounds on what one client request may carry, so no frame or field can take the server down or
slow every agent (the ZeroMQ ingress and the HTTP gateway apply the same ones).

The numbers live in ``configs/limits.toml`` (``[request]``); the defaults here are the same and a
test keeps them equal.  A request over a bound gets ``Error(limit_exceeded)`` naming the limit and
nothing else happens; the text bound is checked before anything is tokenised.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from agentserve.protocol.client_messages import ErrorCode, Hello, OpenSession, ProtocolError, Turn

# Named in the ``limit_exceeded`` that refuses an open past a connection's session bound (``[clients]``): a client
# holding idle sessions (the HTTP gateway's conversation maps) closes one and retries.
SESSION_LIMIT = "limits.clients.max_sessions"


@dataclass(frozen=True, slots=True)
class Limits:
    max_frame_bytes: int = 16 * 2**20  # one msgpack frame
    max_nesting: int = 64  # containers inside containers in tool schemas
    max_messages: int = 4096  # messages in one turn (as many as the HTTP gateway takes in one request)
    max_text_bytes: int = 4 * 2**20  # all message text of one turn, checked before tokenising
    max_token_ids: int = 1 << 20  # raw token ids in one turn
    max_stop_strings: int = 16
    max_stop_bytes: int = 256  # one stop string
    max_name_bytes: int = 256  # session, client, message and tool-call names
    max_system_bytes: int = 1 * 2**20
    max_tools: int = 256
    max_tool_bytes: int = 1 * 2**20  # all tool schemas of a session, as msgpack

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Limits:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown request limits: {sorted(unknown)}")
        limits = cls(**data)
        bad = [f.name for f in dataclasses.fields(cls) if not getattr(limits, f.name) > 0]
        if bad:
            raise ValueError(f"request limits must be > 0: {bad}")
        return limits

    @classmethod
    def announced(cls, values: dict[str, Any]) -> Limits:
        """The limits a server announced (``Welcome.limits``): the defaults for any it did not name; names this
        code does not know and values that are no positive integer (a newer server's) are left out."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items()
                      if k in known and isinstance(v, int) and not isinstance(v, bool) and v > 0})

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


# (request, limit) -> the OpenAI request field it bounds, carried as the error's ``param`` (a session's system
# prompt and a turn's messages are both ``messages`` there); a limit not listed bounds no field of the request.
_PARAMS: dict[tuple[type, str], str] = {
    (OpenSession, "max_system_bytes"): "messages",
    (OpenSession, "max_tools"): "tools",
    (OpenSession, "max_tool_bytes"): "tools",
    (OpenSession, "max_nesting"): "tools",
    (Turn, "max_messages"): "messages",
    (Turn, "max_text_bytes"): "messages",
    (Turn, "max_name_bytes"): "messages",
    (Turn, "max_nesting"): "messages",
    (Turn, "max_token_ids"): "prompt",
    (Turn, "max_stop_strings"): "stop",
    (Turn, "max_stop_bytes"): "stop",
}


def limit_text(name: str, value: int, bound: int, what: str) -> str:
    """How a ``limit_exceeded`` refusal reads, wherever it is checked (the ingress, the HTTP gateway)."""
    return f"{what}: {value} exceeds the limit of {bound} (limits.request.{name})"


def _over(name: str, value: int, bound: int, what: str, msg: Any) -> ProtocolError:
    text = limit_text(name, value, bound, what)
    return ProtocolError(ErrorCode.LIMIT_EXCEEDED, text, req=getattr(msg, "req", 0), session=getattr(msg, "session", 0),
                         param=_PARAMS.get((type(msg), name), ""))


def _check(msg: Any, name: str, value: int, bound: int, what: str) -> None:
    if value > bound:
        raise _over(name, value, bound, what, msg)


def nesting(value: Any, bound: int) -> int:
    """Depth of lists/dicts in ``value`` (iterative; stops counting just past ``bound``)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, dict | list):
            continue
        deepest = max(deepest, depth)
        if deepest > bound:
            return deepest
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children)
    return deepest


def check_limits(msg: Any, limits: Limits, encoded_tools: int = 0) -> None:
    """Raise ``ProtocolError(LIMIT_EXCEEDED)`` for the first bound ``msg`` breaks."""
    if isinstance(msg, Hello):
        _check(msg, "max_name_bytes", len(msg.client.encode()), limits.max_name_bytes, "client name bytes")
    elif isinstance(msg, OpenSession):
        _check_open(msg, limits, encoded_tools)
    elif isinstance(msg, Turn):
        _check_turn(msg, limits)


def _check_open(msg: OpenSession, limits: Limits, encoded_tools: int) -> None:
    _check(msg, "max_name_bytes", len(msg.options.name.encode()), limits.max_name_bytes, "session name bytes")
    _check(msg, "max_system_bytes", len((msg.system or "").encode()), limits.max_system_bytes, "system prompt bytes")
    _check(msg, "max_tools", len(msg.tools), limits.max_tools, "tools")
    _check(msg, "max_tool_bytes", encoded_tools, limits.max_tool_bytes, "tool schema bytes")
    _check(msg, "max_nesting", nesting(msg.tools, limits.max_nesting), limits.max_nesting, "tool schema nesting")


def _check_turn(msg: Turn, limits: Limits) -> None:
    _check(msg, "max_messages", len(msg.messages), limits.max_messages, "messages in the turn")
    _check(msg, "max_token_ids", len(msg.token_ids), limits.max_token_ids, "token ids in the turn")
    _check(msg, "max_stop_strings", len(msg.stop), limits.max_stop_strings, "stop strings")
    longest_stop = max((len(s.encode()) for s in msg.stop), default=0)
    _check(msg, "max_stop_bytes", longest_stop, limits.max_stop_bytes, "bytes in a stop string")
    longest_name = max((len(m.name.encode()) + len(m.tool_call_id.encode()) for m in msg.messages), default=0)
    _check(msg, "max_name_bytes", longest_name, limits.max_name_bytes, "message name + tool_call_id bytes")
    calls = [m.tool_calls for m in msg.messages if m.tool_calls]
    _check(msg, "max_nesting", nesting(calls, limits.max_nesting), limits.max_nesting, "tool call nesting")
    text = sum(m.text_bytes() for m in msg.messages)
    _check(msg, "max_text_bytes", text, limits.max_text_bytes, "message text bytes (content and tool calls)")
