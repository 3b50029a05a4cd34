"""Endpoint strings for the client ingress: defaults, loopback rule, ipc socket files."""

from __future__ import annotations

import ipaddress
import os
import tempfile
from pathlib import Path

IPC_PREFIX = "ipc://"
TCP_PREFIX = "tcp://"


class EndpointError(ValueError):
    """An endpoint string that AgentServe will not bind."""


def runtime_dir() -> Path:
    """Where ipc socket files go: ``$XDG_RUNTIME_DIR`` if usable, else the temp dir."""
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK):
        return Path(xdg)
    return Path(tempfile.gettempdir())


def default_endpoint(run: str = "default") -> str:
    return f"{IPC_PREFIX}{runtime_dir() / f'agentserve-{run}.sock'}"


def ipc_path(endpoint: str) -> Path | None:
    """The socket file of an ``ipc://`` endpoint, else None."""
    return Path(endpoint[len(IPC_PREFIX) :]) if endpoint.startswith(IPC_PREFIX) else None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # an interface name or a hostname: treat as exposed


def _host_port(endpoint: str) -> tuple[str, str]:
    """``tcp://HOST:PORT`` split at its last colon (an IPv6 host keeps its own): ``("", "")`` if it has none."""
    host, sep, port = endpoint[len(TCP_PREFIX) :].rpartition(":")
    return (host, port) if sep else ("", "")


def check_endpoint(endpoint: str) -> str:
    """Validate an endpoint's form, what a client may connect to: ``ipc://PATH`` (absolute path) or
    ``tcp://HOST:PORT``; return it."""
    if endpoint.startswith(IPC_PREFIX):
        path = ipc_path(endpoint)
        if path is None or not path.is_absolute():
            raise EndpointError(f"ipc endpoint needs an absolute path: {endpoint!r}")
        if len(str(path).encode()) > 100:
            raise EndpointError(f"ipc socket path too long for the OS (max ~100 bytes): {path}")
        return endpoint
    if endpoint.startswith(TCP_PREFIX):
        host, port = _host_port(endpoint)
        if not (port == "*" or port.isdigit() and int(port) < 65536) or not host:
            raise EndpointError(f"tcp endpoint must be tcp://HOST:PORT (PORT 0-65535 or *), got {endpoint!r}")
        return endpoint
    raise EndpointError(f"endpoint must start with ipc:// or tcp://, got {endpoint!r}")


def check_bind(endpoint: str, *, allow_remote: bool = False) -> str:
    """Validate an endpoint for binding; return it.

    ``ipc://PATH`` (absolute path, in a folder that exists: binding makes no folders) and
    ``tcp://<loopback>:PORT`` are always fine.  Any other TCP host (``0.0.0.0``, a LAN address, ``*``)
    exposes an unauthenticated server and needs ``allow_remote=True`` (``agentserve up --allow-remote``).
    """
    check_endpoint(endpoint)
    path = ipc_path(endpoint)
    if path is not None:
        if not path.parent.is_dir():
            raise EndpointError(f"cannot bind {endpoint}: the folder {path.parent} does not exist (create it first)")
        return endpoint
    host, _ = _host_port(endpoint)
    if not _is_loopback(host) and not allow_remote:
        raise EndpointError(
            f"refusing to bind {endpoint!r}: it is not a loopback address and the protocol has no "
            "authentication; use ipc://PATH or tcp://127.0.0.1:PORT, or pass --allow-remote"
        )
    return endpoint
