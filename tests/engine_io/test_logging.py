"""Structured log lines: key=value and JSON, with the standard fields and extras."""

from __future__ import annotations

import io
import json
import logging

from agentserve.configs.logging import setup_logging


def _emit(as_json: bool) -> str:
    buf = io.StringIO()
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        setup_logging("debug", json=as_json, stream=buf)
        logging.getLogger("agentserve.test").info("step %d done", 3, extra={"lane": "decode", "ms": 1.5})
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logging.getLogger("agentserve.test").exception("failed")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    return buf.getvalue()


def test_json_lines():
    first, second = _emit(True).splitlines()[:2]
    rec = json.loads(first)
    assert rec["level"] == "INFO" and rec["logger"] == "agentserve.test" and rec["msg"] == "step 3 done"
    assert rec["lane"] == "decode" and rec["ms"] == 1.5 and rec["process"] == "MainProcess"
    assert rec["ts"].endswith("Z")
    assert "RuntimeError: boom" in json.loads(second)["exc"]


def test_key_value_lines():
    line = _emit(False).splitlines()[0]
    assert 'level=INFO logger=agentserve.test process=MainProcess msg="step 3 done" lane=decode ms=1.5' in line
    assert line.startswith("ts=")


def test_the_gateway_process_logs_json_lines_uvicorns_own_too() -> None:
    """``up --log-json --http``: the gateway's lines, uvicorn's included (here: its port is taken), are JSON."""
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cmd = [sys.executable, "-m", "agentserve.gateway", "--endpoint", "ipc:///nonexistent/gw.sock", "--port",
               str(taken.getsockname()[1]), "--log-json"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    lines = done.stderr.splitlines()
    assert done.returncode != 0 and lines, done.stderr
    records = [json.loads(line) for line in lines]
    assert any(r["logger"].startswith("uvicorn") and "address already in use" in r["msg"] for r in records), lines
