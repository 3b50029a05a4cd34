"""The processes of ``agentserve fleet up``: N ``agentserve up --http`` workers and the router in front.

Each member runs in its own session (a Ctrl-C reaches only ``fleet up``, which stops them in order) and,
on Linux, gets SIGTERM if ``fleet up`` itself dies.  Output goes to ``<log_dir>/<member>.log``.  Stopping
sends SIGTERM, then SIGKILL after a grace; a worker that died unclean leaves its shared-memory segments
and ipc socket behind, which :meth:`Worker.clean_up` removes.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket as sock
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentserve.cli.child_process import own_session
from agentserve.cli.up import up
from agentserve.protocol.endpoints import default_endpoint, ipc_path
from agentserve.shm.segment import PREFIX, cleanup_stale

log = logging.getLogger("agentserve.fleet")


def agentserve_executable() -> str:
    exe = Path(sys.executable).with_name("agentserve")
    return str(exe) if exe.is_file() else "agentserve"


def http_get(url: str, timeout: float = 2.0, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """``(status, body)``; ``(0, b"")`` when nothing answers."""
    try:
        request = urllib.request.Request(url, headers=headers or {})
        with urllib.request.urlopen(request, timeout=timeout) as r:  # noqa: S310 - http:// URLs we built
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (OSError, ValueError):
        return 0, b""


def http_json(url: str, headers: dict[str, str] | None = None) -> dict[str, Any] | None:
    """The JSON object ``url`` answers with status 200, else ``None``."""
    status, body = http_get(url, headers=headers)
    if status != 200:
        return None
    try:
        answer = json.loads(body)
    except ValueError:
        return None
    return answer if isinstance(answer, dict) else None


@dataclass
class Member:
    name: str
    command: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    reported_exit: bool = False

    def start(self, env: dict[str, str] | None = None) -> None:
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                self.command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, **own_session(),
            )

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` for the exit, then SIGKILL; the exit code."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0f s; killing it", self.name, timeout)
            self.proc.kill()
            return self.proc.wait()

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class Worker(Member):
    index: int = 0
    run: str = ""
    url: str = ""
    endpoint: str = ""
    model: str = ""  # the name its gateway serves
    api_key: str = field(default="", repr=False)  # the key its gateway wants on /server_info ("" none)

    def healthy(self) -> bool:
        """Serving, and this worker: ``/health`` is 200 and ``/server_info`` names an AgentServe server of this
        worker's run serving its model.  Any program that took the port may answer 200 to ``/health``; the router
        would then route to it."""
        if http_get(self.url + "/health")[0] != 200:
            return False
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        info = http_json(self.url + "/server_info", auth) or {}
        return (info.get("server"), info.get("run"), info.get("served_model_name")) == ("agentserve", self.run,
                                                                                       self.model)

    def clean_up(self, socket: bool = True) -> list[str]:
        """Remove what an unclean exit left: the run's shared memory (only segments whose owner is dead)
        and, with ``socket``, its ipc socket unless something still listens there (a worker restarted by
        hand on the same run)."""
        removed = cleanup_stale(f"{PREFIX}-{self.run}-")
        path = ipc_path(self.endpoint)
        if socket and path is not None and path.exists() and not _listening(path):
            path.unlink(missing_ok=True)
            removed.append(str(path))
        return removed


def _listening(path: Path) -> bool:
    with sock.socket(sock.AF_UNIX, sock.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


def worker_command(model: str, run: str, host: str, port: int, endpoint: str, extra: list[str]) -> list[str]:
    """The ``agentserve up`` of one worker (also what brings a dead worker back on the same port)."""
    return [agentserve_executable(), "up", "--model", model, "--run", run, "--endpoint", endpoint,
            "--http", f"{host}:{port}", *extra]


def make_worker(index: int, name: str, model: str, host: str, port: int, extra: list[str], log_dir: Path) -> Worker:
    run = f"{name}-w{index}"
    endpoint = default_endpoint(run)
    bracketed = f"[{host}]" if ":" in host else host
    return Worker(name=f"worker {index}", command=worker_command(model, run, host, port, endpoint, extra),
                  log_path=log_dir / f"worker{index}.log", index=index, run=run,
                  url=f"http://{bracketed}:{port}", endpoint=endpoint,
                  model=up_option(extra, "served_model_name") or model, api_key=up_option(extra, "api_key") or "")


def up_option(extra: list[str], name: str) -> Any:
    """The value ``up`` gives its option ``name`` with ``extra`` on its command line, read by ``up``'s own parser
    (the last one given wins; an option with an environment variable, ``--api-key``, falls back to it, which the
    worker inherits); None where neither gives one."""
    return up.make_context("up", list(extra), resilient_parsing=True).params.get(name)


def router_command(worker_urls: list[str], host: str, port: int, metrics_port: int, settings: dict[str, Any],
                   extra: list[str]) -> list[str]:
    """``python -m sglang_router.launch_router`` with every ``[router]`` setting as ``--key-with-dashes``."""
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
           "--host", host, "--port", str(port), "--prometheus-host", host, "--prometheus-port", str(metrics_port)]
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            cmd += [flag] if value else []
        else:
            cmd += [flag, str(value)]
    return cmd + extra


@dataclass
class Router(Member):
    url: str = ""
    metrics_url: str = ""
    expected_workers: int = 0
    last_answer: dict[str, Any] = field(default_factory=dict)

    def ready(self) -> bool:
        """Every worker registered and healthy (the router's ``/readiness``)."""
        answer = http_json(self.url + "/readiness")
        if answer is None:
            return False
        self.last_answer = answer
        return answer.get("healthy_workers", 0) >= self.expected_workers


def member_env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}
