"""``GET /health`` and ``GET /v1/models``.

``/health`` is 200 when the orchestrator answers and its executor is serving; 503 while the gateway
is still connecting, while the executor restarts after a crash, or when the orchestrator does not
answer (load balancers take the server out of rotation meanwhile).
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentserve.client import AgentServeError
from agentserve.gateway.backend import Backend
from agentserve.gateway.errors import APIError, unavailable

STARTED = int(time.time())


async def health(request: Request) -> Response:
    backend: Backend = request.app.state.backend
    try:
        snapshot = await backend.stats()
    except (AgentServeError, TimeoutError):
        raise unavailable("the orchestrator does not answer") from None
    except APIError:
        raise
    if snapshot.restarting:
        raise unavailable("the executor is restarting after a crash")
    return Response(status_code=200)


async def models(request: Request) -> Response:
    backend: Backend = request.app.state.backend
    _, welcome, _ = backend.require()
    card = {"id": backend.model_name, "object": "model", "created": STARTED, "owned_by": "agentserve",
            "root": welcome.model, "parent": None, "max_model_len": welcome.max_model_len}
    return JSONResponse({"object": "list", "data": [card]})
