"""What a router asks of a worker: the SGLang server endpoints the SGLang Model Gateway (``sglang-router``,
``smg``) calls on an HTTP worker, with SGLang's shapes, so AgentServe boxes can sit behind it.

Which endpoint the router uses for what (read from sglang-router 0.3.2's source and checked against its
binary; docs/fleet.md cites the files):

* ``GET /health`` (``health`` in :mod:`~agentserve.gateway.info_routes`): registration probe and the
  periodic health check (``--health-check-endpoint``, default ``/health``).
* ``GET /server_info`` and ``GET /model_info``: read once when the worker registers;
  ``served_model_name`` (else ``model_path``) becomes the worker's model id, ``model_type`` and
  ``architectures`` its model card; ``dp_size`` is read with ``--dp-aware``.
* ``GET /get_model_info``: the router's own ``/get_model_info`` forwards to one worker.
* ``GET /get_load``: the router's ``/get_loads`` and the load monitor of ``power_of_two`` (it sums
  ``num_tokens`` over the list, one entry per data-parallel rank).
* ``POST /flush_cache``: the router's ``/flush_cache`` fans out to every worker.
* ``GET /metrics``: the router's ``/engine_metrics`` fans out and merges (already served).
* ``GET /health_generate``: SGLang's deep health check (one generated token), for
  ``--health-check-endpoint /health_generate``.

``/get_server_info`` answers as ``/server_info`` (SGLang serves both names).
"""

from __future__ import annotations

import asyncio
import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentserve.client import AgentServeError
from agentserve.gateway.backend import Backend
from agentserve.gateway.errors import unavailable
from agentserve.protocol.stats import SessionState, Snapshot

HEALTH_GENERATE_TIMEOUT_S = 20.0
_RUNNING = (SessionState.DECODING,)
_WAITING = (SessionState.PREFILLING, SessionState.QUEUED)


def _version() -> str:
    try:
        return version("agentserve")
    except PackageNotFoundError:
        return "unknown"


async def _snapshot(backend: Backend) -> Snapshot:
    try:
        return await backend.stats()
    except (AgentServeError, TimeoutError):
        raise unavailable("the orchestrator does not answer") from None


def checkpoint_config(model_dir: str) -> dict[str, Any]:
    """The checkpoint's ``config.json`` (empty when it cannot be read)."""
    try:
        data = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


async def server_info(request: Request) -> Response:
    backend: Backend = request.app.state.backend
    _, welcome, _ = backend.require()
    snap = await _snapshot(backend)
    return JSONResponse({
        "model_path": welcome.model, "tokenizer_path": welcome.model, "served_model_name": backend.model_name,
        "version": _version(), "server": "agentserve", "dp_size": 1, "tp_size": 1,
        "max_total_tokens": snap.kv.total_blocks * snap.kv.block_size, "context_length": welcome.max_model_len,
        "max_model_len": welcome.max_model_len, "run": welcome.run,
    })


async def model_info(request: Request) -> Response:
    backend: Backend = request.app.state.backend
    _, welcome, _ = backend.require()
    config = await asyncio.to_thread(checkpoint_config, welcome.model)
    architectures = config.get("architectures")
    return JSONResponse({
        "model_path": welcome.model, "tokenizer_path": welcome.model, "served_model_name": backend.model_name,
        "is_generation": True, "model_type": config.get("model_type"),
        "architectures": architectures if isinstance(architectures, list) else None,
        "max_model_len": welcome.max_model_len,
    })


def load_of(snap: Snapshot) -> list[dict[str, int]]:
    """SGLang's ``/get_load``: one entry per data-parallel rank (AgentServe has one)."""
    states = [row.state for row in snap.sessions]
    waiting = sum(s in _WAITING for s in states)
    return [{"dp_rank": 0, "num_reqs": sum(s in _RUNNING for s in states) + waiting, "num_waiting_reqs": waiting,
             "num_tokens": snap.kv.used_blocks * snap.kv.block_size}]


async def get_load(request: Request) -> Response:
    backend: Backend = request.app.state.backend
    return JSONResponse(load_of(await _snapshot(backend)))


async def flush_cache(request: Request) -> Response:
    """Close every idle conversation this gateway holds for continuation (their KV is freed); the next
    turn of each is a full prefill.  Turns in flight and other clients' sessions are untouched."""
    backend: Backend = request.app.state.backend
    backend.require()
    sessions = [*backend.conversations.drain(), *backend.token_conversations.drain()]
    for session in sessions:
        backend.close_later(session)
    return JSONResponse({"success": True, "message": f"closed {len(sessions)} idle conversations",
                         "closed_sessions": len(sessions)})


async def health_generate(request: Request) -> Response:
    """200 once a one-token turn has run through the executor; 503 if it fails or takes too long."""
    backend: Backend = request.app.state.backend
    client, _, tokenizer = backend.require()
    prompt = tokenizer.encode("ping", add_special_tokens=True) or [0]
    try:
        async with asyncio.timeout(HEALTH_GENERATE_TIMEOUT_S):
            session = await backend.open_session(name="http-health-generate", parse_tool_calls=False)
            try:
                async for _ in session.turn(token_ids=prompt, max_tokens=1, temperature=0.0):
                    pass
            finally:
                backend.close_later(session)
    except (AgentServeError, TimeoutError) as e:
        raise unavailable(f"a one-token generation failed: {e or type(e).__name__}") from None
    return Response(status_code=200)
