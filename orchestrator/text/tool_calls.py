"""Qwen / Hermes-style tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

:func:`parse_tool_calls` never raises: a block that is not a valid call becomes an entry in
``errors`` and its raw text stays in ``content`` so nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class ParsedToolCalls:
    content: str  # the text outside valid tool-call blocks, stripped
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _wire_int(text: str) -> int | float:
    """A JSON integer as the client protocol (msgpack) can carry it: past 64 bits, a float (as JavaScript reads it)."""
    if len(text) <= 20:  # longer ones never fit (and int() refuses past 4,300 digits)
        value = int(text)
        if -(2**63) <= value < 2**64:
            return value
    return float(text)


def loads_model_json(text: str) -> Any:
    """``json.loads`` for text a model wrote: integers the wire can carry; nesting too deep is a ``JSONDecodeError``."""
    try:
        return json.loads(text, parse_int=_wire_int)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", text, 0) from None


def parse_call_body(body: str) -> ToolCall | str:
    """One block's JSON → a :class:`ToolCall`, or an error message."""
    try:
        obj = loads_model_json(body)
    except json.JSONDecodeError as e:
        return f"tool call is not valid JSON ({e.msg} at char {e.pos}): {body[:80]!r}"
    if not isinstance(obj, dict):
        return f"tool call must be a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return "tool call has no string 'name'"
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models double-encode the arguments
        try:
            args = loads_model_json(args) if args.strip() else {}
        except json.JSONDecodeError:
            return f"arguments of tool call {name!r} are a string that is not JSON"
    if not isinstance(args, dict):
        return f"arguments of tool call {name!r} must be a JSON object, got {type(args).__name__}"
    return ToolCall(name, args)


def parse_tool_calls(text: str) -> ParsedToolCalls:
    """Split model output into plain content and tool calls (an unclosed last block counts)."""
    result = ParsedToolCalls(content="")
    kept: list[str] = []
    pos = 0
    for m in _BLOCK.finditer(text):
        kept.append(text[pos:m.start()])
        pos = m.end()
        call = parse_call_body(m.group(1).strip())
        if isinstance(call, ToolCall):
            result.calls.append(call)
        else:
            result.errors.append(call)
            kept.append(m.group(0))
    kept.append(text[pos:])
    result.content = "".join(kept).strip()
    return result


def has_tool_call(text: str) -> bool:
    """Cheap check for streaming: has the model started a tool call?"""
    return OPEN in text
