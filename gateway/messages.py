"""OpenAI chat messages → the orchestrator's messages, and the canonical form the conversation map keys on.

Roles: ``system`` and ``developer`` (a system message; the first one becomes the session's system
prompt), ``user``, ``assistant`` (``content`` may be null when it carries ``tool_calls``), ``tool``
(answers ``tool_call_id``).  Content is a string or a list of text parts; every message but such an
assistant's has content (:func:`check_content`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from agentserve.gateway.errors import bad_request
from agentserve.gateway.schemas import ChatMessage, ToolCallIn
from agentserve.orchestrator.text.tool_calls import loads_model_json
from agentserve.protocol.client_messages import Message

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def content_text(content: str | list[dict[str, Any]] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for i, part in enumerate(content):
        if part.get("type") != "text":
            raise bad_request(f"only text content parts are supported (got type {part.get('type')!r})",
                              param=f"{where}.content[{i}]")
        if not isinstance(part.get("text"), str):
            raise bad_request("a text content part needs a string `text`", param=f"{where}.content[{i}].text")
        parts.append(part["text"])
    return "".join(parts)


def check_content(m: ChatMessage, where: str) -> None:
    """A 400 for a message without content (null or missing), as OpenAI answers: only an assistant message that
    carries ``tool_calls`` may leave it null."""
    if m.content is not None or (m.role == "assistant" and m.tool_calls):
        return
    need = "`content` or `tool_calls`" if m.role == "assistant" else "`content` (a string or a list of text parts)"
    raise bad_request(f"{where}: a {m.role} message needs {need}; its content is null or missing",
                      param=f"{where}.content")


def arguments_value(call: ToolCallIn) -> dict[str, Any] | str:
    """The arguments as an object, or as the string the client sent when it is not a JSON object
    (a model's broken call sent back as it was answered; chat templates render a string verbatim)."""
    args = call.function.arguments
    if isinstance(args, dict):
        return args
    try:
        value = loads_model_json(args) if args.strip() else {}
    except json.JSONDecodeError:
        return args
    return value if isinstance(value, dict) else args


@dataclass(frozen=True)
class Canonical:
    """One message as the conversation map compares it (what a client may re-serialise is normalised)."""

    role: str
    text: str
    name: str = ""
    tool_call_id: str = ""
    tool_calls: tuple[tuple[str, str, str], ...] = ()  # (id, name, arguments as sorted JSON)

    def encode(self) -> bytes:
        return json.dumps([self.role, self.text, self.name, self.tool_call_id, self.tool_calls]).encode()


def canonical_args(args: dict[str, Any] | str) -> str:
    """Arguments as the map compares them: an object as sorted JSON, anything else as written."""
    if isinstance(args, str):
        try:
            value = loads_model_json(args)
        except json.JSONDecodeError:
            return args
        if not isinstance(value, dict):
            return args
        args = value
    return json.dumps(args, sort_keys=True, ensure_ascii=False)


@dataclass
class Translated:
    system: str | None  # the first system/developer message, the session's system prompt (None if none)
    messages: list[Message]  # everything after it, in the orchestrator's shape
    canonical: list[Canonical]  # every message, the system prompt included

    @property
    def leading(self) -> int:
        """How many of the request's messages became the system prompt (0 or 1; an empty one counts)."""
        return len(self.canonical) - len(self.messages)


def translate(messages: list[ChatMessage]) -> Translated:
    if not messages:
        raise bad_request("messages must not be empty", param="messages")
    out: list[Message] = []
    canon: list[Canonical] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = ROLES.get(m.role)
        if role is None:
            raise bad_request(f"unknown role {m.role!r} (expected one of {sorted(ROLES)})", param=f"{where}.role")
        check_content(m, where)
        text = content_text(m.content, where)
        calls: list[dict[str, Any]] = []
        keys: list[tuple[str, str, str]] = []
        for c in m.tool_calls or []:
            args = arguments_value(c)
            calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}})
            keys.append((c.id, c.function.name, canonical_args(args)))
        if calls and role != "assistant":
            raise bad_request("only assistant messages carry tool_calls", param=f"{where}.tool_calls")
        out.append(Message(role=role, content=text, tool_call_id=m.tool_call_id or "", name=m.name or "",
                           tool_calls=calls))
        canon.append(Canonical(role, text, m.name or "", m.tool_call_id or "", tuple(keys)))
    system = None
    if out[0].role == "system":
        system = out.pop(0).content
    if not out:
        raise bad_request("messages need at least one message after the system prompt", param="messages")
    return Translated(system, out, canon)
