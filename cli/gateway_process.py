"""The HTTP gateway process beside the orchestrator (``agentserve up --http HOST:PORT``).

Started once the ingress is bound; restarted (with a growing pause) if it exits on its own, as the
executor is; stopped with ``up`` (SIGTERM, then SIGKILL after a grace).  It watches ``up``'s pid and
stops by itself if ``up`` is killed.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time

from agentserve.protocol.endpoints import EndpointError, check_bind

log = logging.getLogger("agentserve.up.gateway")

FIRST_PAUSE_S = 0.5
MAX_PAUSE_S = 10.0
HEALTHY_S = 60.0  # a gateway that ran this long before it exited starts again after the first pause


def parse_http(address: str, allow_remote: bool) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) → (host, port); the loopback rule of the ingress applies."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host or not 0 < int(port) < 65536:
        raise EndpointError(f"--http must be HOST:PORT, got {address!r}")
    check_bind(f"tcp://{host}:{port}", allow_remote=allow_remote)
    host = host.strip("[]")
    check_free(host, int(port))
    return host, int(port)


def check_free(host: str, port: int, flag: str = "--http") -> None:
    """Fail now, before the model loads, if the port is taken (the gateway would fail to bind it on every restart);
    the error names ``flag``, the option the port came from."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds it
        try:
            probe.bind((host, port))
        except OSError as e:
            raise EndpointError(f"{flag} {host}:{port}: {e.strerror or e}") from None


class GatewayProcess:
    def __init__(self, endpoint: str, host: str, port: int, extra: list[str], log_level: str = "INFO",
                 api_key: str = "", log_json: bool = False) -> None:
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
        self.command = [sys.executable, "-m", "agentserve.gateway", "--endpoint", endpoint, "--host", host,
                        "--port", str(port), "--parent-pid", str(os.getpid()), "--log-level", log_level, *extra]
        self.command += ["--log-json"] if log_json else []
        self.env = {**os.environ, "AGENTSERVE_API_KEY": api_key}  # not on the command line: `ps` shows that
        self.proc: subprocess.Popen | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None

    def start(self) -> GatewayProcess:
        self._spawn()
        self._watcher = threading.Thread(target=self._watch, name="gateway-watch", daemon=True)
        self._watcher.start()
        return self

    def _spawn(self) -> None:
        with self._lock:
            if not self._stopping.is_set():
                # its own session: a Ctrl-C reaches only `up`, which stops it in order
                self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, env=self.env,
                                             start_new_session=True)

    def _watch(self) -> None:
        """Restart the gateway whenever it exits on its own: after a pause that doubles while it keeps failing
        (up to ``MAX_PAUSE_S``) and starts again from ``FIRST_PAUSE_S`` once it had run ``HEALTHY_S``."""
        pause = FIRST_PAUSE_S
        while not self._stopping.is_set():
            proc = self.proc
            assert proc is not None
            started = time.monotonic()
            code = proc.wait()
            if self._stopping.is_set():
                return
            if time.monotonic() - started >= HEALTHY_S:
                pause = FIRST_PAUSE_S
            log.error("the HTTP gateway exited with code %s; restarting it in %.1f s", code, pause)
            if self._stopping.wait(pause):
                return
            pause = min(pause * 2, MAX_PAUSE_S)
            self._spawn()

    def stop(self, timeout: float = 5.0) -> int | None:
        self._stopping.set()
        with self._lock:
            proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("the HTTP gateway did not stop within %.0f s; killing it", timeout)
                proc.kill()
        if self._watcher is not None:
            self._watcher.join(timeout=2.0)
        return proc.wait()
