"""A minimal HTTP/1.1 client over asyncio streams: JSON POST with a Server-Sent-Events reply, and GET.

One connection per request (``Connection: close``); both ``Transfer-Encoding: chunked`` and plain
bodies are read. Enough for ``/v1/completions`` and llama.cpp's ``/completion`` without a dependency.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit


class HTTPError(RuntimeError):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


async def _open(url: str, method: str, body: bytes, accept: str):
    u = urlsplit(url)
    if u.scheme != "http" or not u.hostname:
        raise ValueError(f"only http://HOST:PORT URLs are supported, got {url!r}")
    port = u.port or 80
    reader, writer = await asyncio.open_connection(u.hostname, port)
    path = (u.path or "/") + (f"?{u.query}" if u.query else "")
    head = (f"{method} {path} HTTP/1.1\r\nHost: {u.hostname}:{port}\r\nAccept: {accept}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    writer.write(head.encode() + body)
    await writer.drain()
    status_line = await reader.readline()
    parts = status_line.decode("latin-1").split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/"):
        writer.close()
        raise ConnectionError(f"bad HTTP status line from {url}: {status_line!r}")
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        key, _, value = line.decode("latin-1").partition(":")
        headers[key.strip().lower()] = value.strip()
    return int(parts[1]), headers, reader, writer


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                return
            yield await reader.readexactly(size)
            await reader.readexactly(2)
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while piece := await reader.read(65536):
            yield piece


async def _read_all(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    return b"".join([piece async for piece in _body(reader, headers)])


async def get(url: str) -> tuple[int, bytes]:
    """GET ``url``; returns ``(status, body)``."""
    status, headers, reader, writer = await _open(url, "GET", b"", "*/*")
    try:
        return status, await _read_all(reader, headers)
    finally:
        writer.close()


async def post_sse(url: str, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """POST ``payload`` as JSON and yield each SSE ``data:`` event as parsed JSON until ``[DONE]``/EOF."""
    status, headers, reader, writer = await _open(url, "POST", json.dumps(payload).encode(),
                                                  "text/event-stream")
    try:
        if status != 200:
            raise HTTPError(status, (await _read_all(reader, headers)).decode("utf-8", "replace"))
        buf = b""
        async for piece in _body(reader, headers):
            buf = (buf + piece).replace(b"\r\n", b"\n")
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                data = b"\n".join(ln[5:].lstrip() for ln in event.split(b"\n") if ln.startswith(b"data:"))
                if not data:
                    continue
                if data == b"[DONE]":
                    return
                obj = json.loads(data)
                if isinstance(obj, dict) and "error" in obj:
                    raise HTTPError(status, json.dumps(obj["error"]))
                yield obj
    finally:
        writer.close()
