"""Prompts given on the command line or in a JSONL file, checked with clear messages."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Prompt:
    """Exactly one of ``text``, ``ids`` or ``messages`` is set."""

    text: str | None = None
    ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None


def parse_ids(text: str) -> list[int]:
    """``"1, 2,3"`` → ``[1, 2, 3]``."""
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise ValueError("--prompt-ids is empty")
    return ids


def check_unicode(value: Any, where: str) -> None:
    """``ValueError`` naming ``where`` for text that is no Unicode a tokenizer takes: a lone surrogate (``"\\ud800"``
    in JSON, undecodable bytes on a command line)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{where}: not valid Unicode text ({e.reason})") from None


def _is_id_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def _is_message_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def parse_line(obj: Any, where: str) -> Prompt:
    """One JSONL object → a :class:`Prompt`; ``ValueError`` naming ``where`` when it is malformed."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    check_unicode(obj, where)
    keys = [k for k in ("prompt", "prompt_ids", "messages") if k in obj]
    if len(keys) != 1:
        raise ValueError(f"{where}: needs exactly one of 'prompt', 'prompt_ids', 'messages'")
    value = obj[keys[0]]
    if keys[0] == "prompt" and isinstance(value, str):
        return Prompt(text=value)
    if keys[0] == "prompt_ids" and _is_id_list(value) and value:
        return Prompt(ids=value)
    if keys[0] == "messages" and _is_message_list(value):
        tools = obj.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ValueError(f"{where}: 'tools' must be a list of JSON schemas")
        return Prompt(messages=value, tools=tools)
    expected = {"prompt": "a string", "prompt_ids": "a non-empty list of integers",
                "messages": "a non-empty list of {role, content} objects"}[keys[0]]
    raise ValueError(f"{where}: '{keys[0]}' must be {expected}")


def load_prompts_file(path: str | Path) -> list[Prompt]:
    """Read a JSONL prompts file (blank lines skipped)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ValueError(f"prompts file not found: {path}") from None
    except UnicodeDecodeError:
        raise ValueError(f"prompts file {path} is not UTF-8 text") from None
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        prompts.append(parse_line(obj, f"{path}:{n}"))
    if not prompts:
        raise ValueError(f"prompts file {path} has no prompts")
    return prompts
