"""The server's request limits (``configs/limits.toml``'s ``[request]``, announced in its ``Welcome``), checked by the
gateway where it works before the orchestrator can: it tokenises a prompt given as text itself (``/v1/completions``,
``/tokenize``), and ``/tokenize`` renders a conversation no turn ever carries.  Everything a turn carries is checked
by the orchestrator, on what the turn sends (a continued conversation sends only its new messages or tokens).
A refusal reads as the orchestrator's own: 400, code ``limit_exceeded``, the field in ``param``, the limit named.
"""

from __future__ import annotations

from typing import Any

import msgspec

from agentserve.client.errors import from_event
from agentserve.gateway.errors import APIError, from_client_error
from agentserve.gateway.messages import Translated
from agentserve.protocol.client_messages import ErrorCode, OpenSession, ProtocolError, Turn
from agentserve.protocol.limits import Limits, check_limits, limit_text


def refusal(error: ProtocolError) -> APIError:
    """The 400 for a request the server's limits refuse, as the orchestrator's refusal reaches an HTTP client."""
    return from_client_error(from_event(error.to_event()))


def check_prompt_text(text: str, limits: Limits) -> None:
    """A prompt's text within ``max_text_bytes``, checked before the gateway tokenises it (megabytes take seconds).
    It bounds the text tokenised for one request: a continued completion resends its whole prompt."""
    size = len(text.encode())
    if size > limits.max_text_bytes:
        what = limit_text("max_text_bytes", size, limits.max_text_bytes, "prompt text bytes")
        raise refusal(ProtocolError(ErrorCode.LIMIT_EXCEEDED, what, param="prompt"))


def check_conversation(t: Translated, tools: list[dict[str, Any]], limits: Limits) -> None:
    """A conversation within what the server takes as a cold chat request sends it: a session (system prompt and
    tools), then one turn of every other message."""
    try:
        session = OpenSession(req=0, version=0, system=t.system, tools=tools)
        check_limits(session, limits, encoded_tools=len(msgspec.msgpack.encode(tools)))
        check_limits(Turn(req=0, session=0, messages=t.messages), limits)
    except ProtocolError as e:
        raise refusal(e) from None

