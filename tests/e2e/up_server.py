"""``agentserve up --model tiny`` in a subprocess, for the end-to-end tests.

``AGENTSERVE_TEST_DEVICE`` (default ``cpu``) is the device the server and the tests' offline reference run on:
``cuda`` runs the same tests through the GPU path (scripts/gpu_serve_check.sh does, on the device machine)."""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from pathlib import Path

DEVICE = os.environ.get("AGENTSERVE_TEST_DEVICE", "cpu")


class UpServer:
    def __init__(self, tmp: Path, extra_args: list[str] | None = None) -> None:
        self.run = f"e2e{uuid.uuid4().hex[:6]}"
        self.sock = tmp / "as.sock"
        self.endpoint = f"ipc://{self.sock}"
        self.trace = tmp / "steps.jsonl"
        cmd = ["agentserve", "up", "--model", "tiny", "--run", self.run, "--endpoint", self.endpoint]
        cmd += ["--trace-steps", str(self.trace)]
        cmd += ["--device", DEVICE, "--dtype", "float32", "--num-blocks", "512", "--max-model-len", "2048"]
        cmd += extra_args or []
        self.log_path = tmp / "up.log"
        self.log = open(self.log_path, "w+")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.proc.stdout.readline()
        assert "ready on" in line, f"server did not start: {line!r}\n{self.logs()}"

    def logs(self) -> str:
        return self.log_path.read_text()

    def executor_pid(self) -> int:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(out) == 1, out
        return int(out[0])

    def stop(self) -> int:
        """SIGTERM, as a user stops it (SIGKILL only if it does not exit in 30 s); the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode
