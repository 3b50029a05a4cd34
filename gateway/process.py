"""``python -m agentserve.gateway``: the gateway process (``agentserve up --http`` starts and watches it).

uvicorn serves the Starlette app; the process ends on SIGTERM / SIGINT (uvicorn's own handlers, a
short grace for open streams), and by itself when the process that started it is gone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys

import uvicorn

from agentserve.configs.logging import LOG_LEVELS, setup_logging
from agentserve.gateway.app import build_app
from agentserve.gateway.backend import GatewayOptions
from agentserve.protocol.endpoints import EndpointError, check_bind

log = logging.getLogger("agentserve.gateway")

API_KEY_ENV = "AGENTSERVE_API_KEY"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m agentserve.gateway", description=__doc__)
    p.add_argument("--endpoint", required=True, help="the orchestrator's ZeroMQ endpoint")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--allow-remote", action="store_true", help="allow a non-loopback address")
    p.add_argument("--served-model-name", default="")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV, ""))
    p.add_argument("--metrics-compat", default="", help="comma-separated: vllm")
    p.add_argument("--max-body-bytes", type=int, default=8 * 2**20)
    p.add_argument("--tokenize-inline-bytes", type=int, default=GatewayOptions.tokenize_inline_bytes,
                   help="a larger body tokenises on a thread of its own (limits.clients.tokenize_inline_bytes)")
    p.add_argument("--max-tokenizing-bytes", type=int, default=GatewayOptions.max_tokenizing_bytes,
                   help="bodies waiting for that thread; more: 503 busy (limits.clients.max_tokenizing_bytes)")
    p.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone")
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS)
    p.add_argument("--log-json", action="store_true", help="JSON log lines (uvicorn's own included)")
    return p.parse_args(argv)


def check_host(host: str, allow_remote: bool) -> None:
    """The same loopback rule as the ZeroMQ ingress."""
    check_bind(f"tcp://{host}:1", allow_remote=allow_remote)


async def _watch_parent(server: uvicorn.Server, pid: int) -> None:
    while True:
        await asyncio.sleep(1.0)
        if os.getppid() != pid:
            log.warning("the process that started the gateway is gone; stopping")
            server.should_exit = True
            return


async def serve(args: argparse.Namespace) -> None:
    options = GatewayOptions(
        endpoint=args.endpoint, served_model_name=args.served_model_name, api_key=args.api_key,
        max_body_bytes=args.max_body_bytes, tokenize_inline_bytes=args.tokenize_inline_bytes,
        max_tokenizing_bytes=args.max_tokenizing_bytes,
        metrics_compat=tuple(m for m in args.metrics_compat.split(",") if m),
    )
    config = uvicorn.Config(build_app(options), host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=2, access_log=False,
                            log_config=None)  # uvicorn's loggers go through this process's handler and format
    server = uvicorn.Server(config)
    watcher = asyncio.create_task(_watch_parent(server, args.parent_pid)) if args.parent_pid else None
    try:
        await server.serve()
    finally:
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.log_level, args.log_json)
    try:
        check_host(args.host, args.allow_remote)
    except EndpointError as e:
        print(f"agentserve gateway: {e}", file=sys.stderr)
        return 2
    asyncio.run(serve(args))
    return 0
