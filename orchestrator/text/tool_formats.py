"""Tool-call formats of the supported model families, chosen from the checkpoint's chat template.

- ``hermes`` (Qwen2.5 / Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks.
- ``llama3_json`` (Llama 3.1 / 3.2): a bare JSON object ``{"name": ..., "parameters": {...}}`` as the
  whole reply (after ``<|python_tag|>``, a special token that decoded text drops); several calls are
  separated by ``;``.  A reply whose first object is no call (known once it is whole), or that stops being
  JSON before it is, is plain text; until then it is held back.

:meth:`ToolCallFormat.scan` reads text as far as the model has written it, for streaming: the content
before the first call (a tail that may still become a call is held back), and each call's name once
its string is complete and its arguments' JSON text as far as it can no longer change.  Everything a
scan reports is a prefix of what a later scan of the longer text reports.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from agentserve.orchestrator.text.json_prefix import may_be_json
from agentserve.orchestrator.text.tool_calls import CLOSE, OPEN, ToolCall, loads_model_json, parse_call_body

# `{"name": "<string>", "arguments": ` at the start of a call's JSON (the order models are taught)
_HEAD = r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
_HEAD_RE = re.compile(_HEAD)


@dataclass
class CallText:
    """One call as far as it is written."""

    name: str | None  # known once its JSON string is complete (None: not yet, or not in the usual order)
    args: str  # the arguments' JSON text that can no longer change
    complete: bool  # the call's text is complete
    call: ToolCall | None = None  # the parsed call, once complete and valid
    exact_args: bool = False  # complete, valid, and ``args`` is exactly its arguments' text


@dataclass
class Scan:
    content: str  # the text before the first call that is safe to show
    calls: list[CallText]


def _held_tail_start(rest: str) -> int:
    """Where the trailing whitespace and ``}`` of ``rest`` begin: they may still be the end of the call object,
    not of its arguments.  Walks the tail only (a regex search from every position made streaming quadratic)."""
    i = len(rest)
    while i and (rest[i - 1] == "}" or rest[i - 1].isspace()):
        i -= 1
    return i


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _json_string(inner: str) -> str | None:
    """The string a JSON string literal's inside (between its quotes) stands for; None if it is not valid JSON."""
    try:
        return json.loads(f'"{inner}"')
    except json.JSONDecodeError:  # a bad escape or a raw control character the model wrote
        return None


def call_text(body: str, complete: bool) -> CallText:
    """A call's JSON ``body`` as far as it is written (``complete``: nothing more will come)."""
    head = _HEAD_RE.match(body)
    name = _json_string(head.group(1)) if head else None
    if not complete:
        if head is None:
            return CallText(None, "", False)
        rest = body[head.end():]
        return CallText(name, rest[: _held_tail_start(rest)], False)
    parsed = parse_call_body(body.strip())
    call = parsed if isinstance(parsed, ToolCall) else None
    if head is None or call is None:
        return CallText(call.name if call else None, call.arguments_json() if call else "", True, call)
    rest = body[head.end():].rstrip()
    args = rest[:-1].rstrip() if rest.endswith("}") else rest
    try:
        exact = loads_model_json(args) == call.arguments and name == call.name
    except json.JSONDecodeError:
        exact = False
    return CallText(name, args if exact else call.arguments_json(), True, call, exact)


class ToolCallFormat:
    name = ""

    def scan(self, text: str, final: bool) -> Scan:
        raise NotImplementedError

    def parse(self, text: str) -> list[ToolCall]:
        """The valid calls of a finished reply."""
        return [c.call for c in self.scan(text, final=True).calls if c.call is not None]


class HermesFormat(ToolCallFormat):
    name = "hermes"

    def scan(self, text: str, final: bool) -> Scan:
        start = text.find(OPEN)
        if start < 0:
            if final:
                return Scan(text, [])
            return Scan(text[: len(text) - _held_prefix(text, OPEN)].rstrip(), [])
        calls = []
        for block in text[start:].split(OPEN)[1:]:
            end = block.find(CLOSE)
            if end >= 0:
                calls.append(call_text(block[:end], True))
            else:  # a tail that may be the start of the closing tag is not part of the call's JSON
                calls.append(call_text(block if final else block[: len(block) - _held_prefix(block, CLOSE)], final))
        return Scan(text[:start].rstrip(), calls)


class Llama3JsonFormat(ToolCallFormat):
    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def scan(self, text: str, final: bool) -> Scan:
        body = text.removeprefix(self.PYTHON_TAG).lstrip()
        if not body.startswith("{"):
            if not final and (not body or self.PYTHON_TAG.startswith(text.lstrip())):
                return Scan("", [])  # nothing yet, or what may still become the tag
            return Scan(text, [])
        calls = self._calls(body, final)
        if _HEAD_RE.match(body) is None and not self._may_be_call(body, calls[0]):
            return Scan(text, [])  # no call after all: plain text, shown as soon as that is known
        return Scan("", calls)

    @staticmethod
    def _may_be_call(body: str, first: CallText) -> bool:
        """Whether the first object, not begun the usual way (a call's name first), is or may become a call."""
        return first.call is not None if first.complete else may_be_json(body)

    @staticmethod
    def _calls(body: str, final: bool) -> list[CallText]:
        calls: list[CallText] = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body) and body[pos] == "{":
            try:
                _, end = decoder.raw_decode(body, pos)
            except (json.JSONDecodeError, RecursionError):  # not yet whole, no JSON, or nested too deeply
                calls.append(call_text(body[pos:], final))
                break
            calls.append(call_text(body[pos:end], True))
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return calls


FORMATS: dict[str, type[ToolCallFormat]] = {"hermes": HermesFormat, "llama3_json": Llama3JsonFormat}


def format_for_template(template: str) -> ToolCallFormat:
    """The tool-call format a chat template teaches (Llama 3.1's ``<|python_tag|>``, else Hermes)."""
    if "<|python_tag|>" in template or "<|eom_id|>" in template:
        return Llama3JsonFormat()
    return HermesFormat()
