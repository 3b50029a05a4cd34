"""Server-sent events as OpenAI streams them: ``data: <json>`` blocks, then ``data: [DONE]``."""

from __future__ import annotations

from typing import Any

import msgspec

_encode = msgspec.json.Encoder().encode

DONE = b"data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(obj: Any) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"
