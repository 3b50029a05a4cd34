"""What a turn yields to SDK users, and how wire events become those events."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentserve.client.errors import AgentServeError, ProtocolViolation, from_event
from agentserve.protocol.client_messages import (
    Error,
    FinishReason,
    Timings,
    TokenEvent,
    ToolCallEvent,
    TurnDone,
    Usage,
)


@dataclass(frozen=True, slots=True)
class TokenIds:
    """New token ids; ``t_server``: the server's monotonic clock, ``t_wall``: its wall clock.

    With ``logprobs=True`` on the turn, ``logprobs[i]`` is ``token_ids[i]``'s log-probability and, with
    ``top_logprobs=k``, ``top_logprobs[i]`` the ``k`` most likely ``(token id, logprob)`` at its position,
    most likely first; both are empty otherwise."""

    token_ids: list[int]
    t_server: float
    t_wall: float
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]

    def arguments_json(self) -> str:
        return json.dumps(self.arguments)


@dataclass(frozen=True, slots=True)
class Done:
    finish: FinishReason
    usage: Usage
    timings: Timings


TurnEvent = TokenIds | TextDelta | ToolCall | Done


def translate(event: Any) -> list[TurnEvent]:
    """SDK events for one wire event of a turn; raises the typed error for an ``Error`` event."""
    if isinstance(event, TokenEvent):
        tops = [list(zip(t.token_ids, t.logprobs, strict=False)) for t in event.top_logprobs]
        out: list[TurnEvent] = [TokenIds(event.token_ids, event.t_mono, event.t_wall, event.logprobs, tops)]
        if event.text:
            out.append(TextDelta(event.text))
        return out
    if isinstance(event, ToolCallEvent):
        return [ToolCall(event.call_id, event.name, dict(event.arguments))]
    if isinstance(event, TurnDone):
        return [Done(event.finish, event.usage, event.timings)]
    if isinstance(event, Error):
        raise from_event(event)
    raise ProtocolViolation(f"unexpected {type(event).__name__} in a turn's stream", req=event.req)


@dataclass
class TurnResult:
    """Everything one turn produced, accumulated from its events."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    done: Done | None = None
    logprobs: list[float] = field(default_factory=list)  # per token, when the turn asked for them
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    def add(self, event: TurnEvent) -> None:
        if isinstance(event, TokenIds):
            self.token_ids.extend(event.token_ids)
            self.logprobs.extend(event.logprobs)
            self.top_logprobs.extend(event.top_logprobs)
        elif isinstance(event, TextDelta):
            self.text += event.text
        elif isinstance(event, ToolCall):
            self.tool_calls.append(event)
        else:
            self.done = event

    @property
    def finish(self) -> FinishReason | None:
        return self.done.finish if self.done else None

    @property
    def usage(self) -> Usage | None:
        return self.done.usage if self.done else None

    @property
    def timings(self) -> Timings | None:
        return self.done.timings if self.done else None


class TurnCore:
    """The transport-free part of a turn's stream: wire events in, SDK events out, result kept."""

    def __init__(self, req: int, on_error: Callable[[], None] | None = None) -> None:
        self.req = req
        self.result = TurnResult()
        self.finished = False
        # Ended on the client side (Ctrl-C, a timeout, a cancelled task) with an abort sent, the turn may still run on
        # the server, which refuses the session's next turn until it ends: its events stay routed till then.
        self.given_up = False
        self._on_error = on_error  # the server ended the turn with an error (and kept nothing of it)

    @staticmethod
    def ends_turn(wire_event: Any) -> bool:
        """Whether ``wire_event`` is the server's last event of a turn."""
        return isinstance(wire_event, TurnDone | Error)

    def accept(self, wire_event: Any) -> list[TurnEvent]:
        try:
            events = translate(wire_event)
        except BaseException as e:
            self.finished = True
            if self._on_error is not None and isinstance(e, AgentServeError):
                self._on_error()
            raise
        for event in events:
            self.result.add(event)
            if isinstance(event, Done):
                self.finished = True
        return events
