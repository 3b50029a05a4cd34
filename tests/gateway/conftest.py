"""One ``agentserve up --model tiny --http 127.0.0.1:PORT`` for every test of this folder.

Start-up costs seconds, so the server has package scope; the shared-memory check of the project's
conftest then runs once, when the server has stopped (a module of this folder would otherwise see
the shared server's segments as its own leak).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest

API_KEY = "test-key-7f3a"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HttpServer:
    def __init__(self, tmp: Path, extra: list[str] | None = None, api_key: str = "") -> None:
        self.run = f"gw{uuid.uuid4().hex[:6]}"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.endpoint = f"ipc://{tmp}/as.sock"
        cmd = ["agentserve", "up", "--model", "tiny", "--run", self.run, "--endpoint", self.endpoint,
               "--http", f"127.0.0.1:{self.port}", "--dtype", "float32", "--num-blocks", "1024",
               "--max-model-len", "4096", *(extra or [])]
        env = {**os.environ, "AGENTSERVE_API_KEY": api_key}
        self.log = open(tmp / "up.log", "w+")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        try:
            line = self.proc.stdout.readline()
            assert "ready on" in line and self.url in line, f"server did not start: {line!r}\n{self.logs()}"
            self.wait_healthy()
        except BaseException:
            self.stop()  # a server that never became healthy is not left running after the failed fixture
            raise

    def wait_healthy(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"/health not 200 after {timeout} s\n{self.logs()}")

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def snapshot(self):
        """The orchestrator's stats, over the ZeroMQ protocol."""
        from agentserve.client import AgentClient
        from agentserve.protocol.stats import decode_snapshot

        with AgentClient(self.endpoint) as client:
            return decode_snapshot(client.stats())

    def answered(self, path: str) -> dict[str, float]:
        """``agentserve:http_requests_total`` for ``path``, by status."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics").text
        return {s.labels["status"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "agentserve:http_requests_total" and s.labels.get("path") == path}

    def answered_once(self, path: str, before: dict[str, float], timeout: float = 10.0) -> dict[str, float]:
        """How the count of ``path``'s answers by status grew since ``before`` (:meth:`answered`), once it has."""
        deadline = time.monotonic() + timeout
        while (after := self.answered(path)) == before and time.monotonic() < deadline:
            time.sleep(0.02)
        return {status: n - before.get(status, 0) for status, n in after.items() if n != before.get(status, 0)}

    def logs(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        return self.proc.wait()


@pytest.fixture(autouse=True, scope="module")
def no_leftover_shared_memory():
    """Overrides the per-module check: :func:`http_server` checks /dev/shm once it has stopped."""
    yield


@pytest.fixture(scope="package")
def http_server(tmp_path_factory: pytest.TempPathFactory):
    server = HttpServer(tmp_path_factory.mktemp("gw"), extra=["--metrics-compat", "vllm"], api_key=API_KEY)
    yield server
    logs = server.logs()
    assert server.stop() == 0, logs
    leftovers = [n for n in os.listdir("/dev/shm") if server.run in n]
    assert not leftovers, leftovers
    gateways = subprocess.run(["pgrep", "-f", f"agentserve.gateway.*{server.port}"], capture_output=True, text=True)
    assert not gateways.stdout.strip(), "the gateway outlived `up`"


@pytest.fixture
def openai_client(http_server: HttpServer):
    from openai import OpenAI

    with OpenAI(base_url=http_server.base_url, api_key=http_server.api_key, max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture
def http(http_server: HttpServer):
    with httpx.Client(base_url=http_server.url, headers=http_server.headers(), timeout=120) as client:
        yield client
