"""``GET /health``, ``GET /v1/models`` (and ``/v1/models/{id}``) and ``GET /metrics``.

``/health`` is 200 when the orchestrator answers and its executor is serving; 503 while the gateway
is still connecting, while the executor restarts after a crash, or when the orchestrator does not
answer (load balancers take the server out of rotation meanwhile).
"""

from __future__ import annotations

import contextlib
import time

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentserve.client import AgentServeError
from agentserve.gateway.backend import Backend
from agentserve.gateway.errors import unavailable

STARTED = int(time.time())


async def health(request: Request) -> Response:
    backend: Backend = request.app.state.backend
    try:
        snapshot = await backend.stats()
    except (AgentServeError, TimeoutError):
        raise unavailable("the orchestrator does not answer") from None
    if snapshot.restarting:
        raise unavailable("the executor is restarting after a crash")
    return Response(status_code=200)


def _card(backend: Backend) -> dict[str, object]:
    _, welcome, _ = backend.require()
    return {"id": backend.model_name, "object": "model", "created": STARTED, "owned_by": "agentserve",
            "root": welcome.model, "parent": None, "max_model_len": welcome.max_model_len}


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_card(request.app.state.backend)]})


async def model(request: Request) -> Response:
    """``GET /v1/models/{id}``: the served model's card under its served name or its checkpoint path; else 404."""
    backend: Backend = request.app.state.backend
    backend.check_model(request.path_params["model"])
    return JSONResponse(_card(backend))


async def metrics(request: Request) -> Response:
    """Prometheus text; the gauges are refreshed from the orchestrator's stats (kept as they were if it
    does not answer in time)."""
    backend: Backend = request.app.state.backend
    if backend.metrics is None:
        raise unavailable("the gateway is still connecting to the orchestrator")
    with contextlib.suppress(AgentServeError, TimeoutError):
        filed = len(backend.conversations) + len(backend.token_conversations)
        backend.metrics.on_snapshot(await backend.stats(timeout=1.0), filed)
    return Response(backend.metrics.render(), media_type=CONTENT_TYPE_LATEST)
