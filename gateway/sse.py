"""Server-sent events as OpenAI streams them: ``data: <json>`` blocks, then ``data: [DONE]``."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
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


async def counted(events: AsyncGenerator[bytes, None], metrics: Any) -> AsyncIterator[bytes]:
    """``events``, counted in ``agentserve:http_open_streams`` (``metrics``: the gateway's, or None) while the
    stream is open: every streamed endpoint's answer goes through here.  Closing this closes ``events`` at once
    (its cleanup aborts the turns of a client that went away)."""
    if metrics is not None:
        metrics.open_streams.inc()
    try:
        async with contextlib.aclosing(events):
            async for event in events:
                yield event
    finally:
        if metrics is not None:
            metrics.open_streams.inc(-1)
