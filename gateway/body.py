"""Request bodies read with a size bound (413 past it), before any parsing; a client that closes the connection
before its body is whole gets a 499 (never read), not a 500 with a traceback for something the server did not do."""

from __future__ import annotations

from starlette.requests import ClientDisconnect, Request

from agentserve.gateway.errors import bad_request, client_closed, too_large


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise bad_request("invalid Content-Length")
        if int(declared) > limit:
            raise too_large(limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise client_closed() from None
    return b"".join(chunks)
