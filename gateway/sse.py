"""Server-sent events as OpenAI streams them: ``data: <json>`` blocks, then ``data: [DONE]``."""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from agentserve.gateway.errors import APIError

log = logging.getLogger("agentserve.gateway")

_encode = msgspec.json.Encoder().encode

DONE = b"data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(obj: Any) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


def server_error(exc: BaseException) -> APIError:
    """What a stream whose headers are sent says of an unexpected failure (logged here with its traceback)."""
    log.error("unexpected error in a stream", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}", type="server_error")
