"""Whether text a model is writing may still become JSON, as Python's ``json`` reads it.

:func:`may_be_json` answers for streaming: a reply that starts like a JSON tool call is held back only
while it can still be one.  It reads the text once, lexeme by lexeme, with a stack of the open
containers (no recursion, so any nesting is fine), and stops at the first character JSON rules out.
"""

from __future__ import annotations

import re

_WS = re.compile(r"[ \t\n\r]*")
_STRING = r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*'
_NUMBER = r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?"
_LEXEME = re.compile(rf'{_STRING}"|{_NUMBER}|true|false|null|NaN|-?Infinity|[{{}}\[\]:,]')
# the start of a string or a number that the end of the text cuts (a complete one matches too)
_CUT_NUMBER = r"-?(?:(?:0|[1-9]\d*)(?:\.\d+(?:[eE][-+]?\d*)?|\.|[eE][-+]?\d*)?)?"
_CUT = re.compile(rf"{_STRING}(?:\\(?:u[0-9a-fA-F]{{0,3}})?)?|{_CUT_NUMBER}")
_WORDS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")
_OPEN = {"{": "k}", "[": "v]"}  # what may follow an opening bracket: a key or "}", a value or "]"
_CLOSE = {"{": "}", "[": "]"}
_VALUE = ("v", "v]")


def _next(expect: str, stack: list[str], kind: str) -> str | None:
    """What may come after a lexeme of ``kind`` (a bracket, ``:``, ``,``, ``s`` a string, ``x`` another value)
    where ``expect`` was expected: ``","`` a comma or a closing bracket, ``""`` nothing (the value is whole);
    None if JSON does not allow it there."""
    if kind in _OPEN and expect in _VALUE:
        stack.append(kind)
        return _OPEN[kind]
    if kind in "}]" and stack and kind == _CLOSE[stack[-1]] and expect in (",", _OPEN[stack[-1]]):
        stack.pop()
        return "," if stack else ""
    if kind == "s" and expect in ("k", "k}"):
        return ":"
    if kind in "sx" and expect in _VALUE:
        return "," if stack else ""
    if kind == ":" and expect == ":":
        return "v"
    if kind == "," and expect == ",":
        return "k" if stack[-1] == "{" else "v"
    return None


def _cut_at_end(rest: str, expect: str) -> bool:
    """May ``rest``, the text's last lexeme cut short by its end, come where ``expect`` is expected?"""
    if _CUT.fullmatch(rest) is None:
        return expect in _VALUE and len(rest) < len("-Infinity") and any(w.startswith(rest) for w in _WORDS)
    return expect in _VALUE or (rest[0] == '"' and expect in ("k", "k}"))


def may_be_json(text: str) -> bool:
    """True if ``text`` is the start of a JSON value (or starts with a whole one): more text may make it JSON."""
    stack: list[str] = []
    expect = "v"
    pos = _WS.match(text).end()
    while pos < len(text):
        lexeme = _LEXEME.match(text, pos)
        if lexeme is None or _CUT.match(text, pos).end() == len(text):
            return _cut_at_end(text[pos:], expect)
        token = lexeme.group()
        after = _next(expect, stack, token if token in "{}[]:," else "s" if token[0] == '"' else "x")
        if not after:
            return after == ""  # a whole value, or a lexeme JSON does not allow here
        expect, pos = after, _WS.match(text, lexeme.end()).end()
    return True
