"""The server's request limits (``configs/limits.toml``'s ``[request]``, as its ``Welcome`` announces them), checked
by the gateway where it would otherwise do work the orchestrator refuses afterwards: tokenising a prompt given as
text (``/v1/completions``, ``/tokenize``), translating thousands of messages.  The refusal reads as the
orchestrator's own: a 400 with code ``limit_exceeded`` naming ``limits.request.<name>``.
"""

from __future__ import annotations

from agentserve.gateway.errors import APIError, bad_request
from agentserve.gateway.messages import Translated
from agentserve.protocol.client_messages import ErrorCode
from agentserve.protocol.limits import Limits, limit_text


def over_limit(name: str, value: int, limits: Limits, what: str, param: str) -> APIError:
    """The 400 for ``value`` over the server's limit ``name``."""
    return bad_request(limit_text(name, value, getattr(limits, name), what), param=param,
                       code=ErrorCode.LIMIT_EXCEEDED.value)


def check_prompt_text(text: str, limits: Limits, param: str = "prompt") -> None:
    """Refuse a prompt's text over ``max_text_bytes`` before it is tokenised (megabytes take seconds)."""
    size = len(text.encode())
    if size > limits.max_text_bytes:
        raise over_limit("max_text_bytes", size, limits, "prompt text bytes", param)


def check_conversation(t: Translated, limits: Limits) -> None:
    """A whole conversation within what the server takes as a session's system prompt and one turn's messages
    (a cold chat request sends it so)."""
    if len(t.messages) > limits.max_messages:
        raise over_limit("max_messages", len(t.messages), limits, "messages in the turn", "messages")
    text = sum(m.text_bytes() for m in t.messages)
    if text > limits.max_text_bytes:
        raise over_limit("max_text_bytes", text, limits, "message text bytes (content and tool calls)", "messages")
    system = len(t.system.encode())
    if system > limits.max_system_bytes:
        raise over_limit("max_system_bytes", system, limits, "system prompt bytes", "messages")
