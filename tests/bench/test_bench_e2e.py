"""End to end: `agentserve bench` starts real `agentserve up` servers (tiny model): one count, then a short sweep."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_short_bench_against_a_real_server(tmp_path):
    out = tmp_path / "out.json"
    exe = Path(sys.executable).with_name("agentserve")
    cmd = [str(exe) if exe.is_file() else "agentserve", "bench", "--workload", "react", "--agents", "2",
           "--policies", "agentserve", "--duration", "20", "--model", "tiny", "--tool-latency-median", "0.2",
           "--steps", "3",  # tiny has 4096 positions: 3 turns of react always fit
           "--json", str(out), "--keep-logs", str(tmp_path / "logs")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figs = json.loads(out.read_text())["policies"]["agentserve"]
    assert figs["errors"] == 0
    assert figs["ttft_cold"]["count"] >= 2  # both agents got through their cold prefill
    assert figs["ttft_resume"]["count"] >= 1
    assert figs["tpot"]["p95"] > 0 and figs["throughput_tok_s"] > 0
    assert figs["ratios"]["tpot_p95"] == pytest.approx(1.0)
    log = (tmp_path / "logs" / "react-agentserve-agents2-seed0.log").read_text()  # the server's whole log, kept
    assert "ready" in log and "shut down cleanly" in log, log[-2000:]


def test_short_sweep_against_real_servers(tmp_path):
    """Two agent counts x two policies, each a fresh `agentserve up` (about a minute on two busy cores)."""
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    exe = Path(sys.executable).with_name("agentserve")
    cmd = [str(exe) if exe.is_file() else "agentserve", "bench", "--workload", "react", "--agents", "1,2",
           "--policies", "agentserve,fcfs", "--duration", "5", "--model", "tiny", "--tool-latency-median", "0.2",
           "--steps", "3", "--json", str(out), "--plot", str(png)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [r["agents"] for r in data["rows"]] == [1, 2] and data["meta"]["failed"] == {}
    for row in data["rows"]:
        assert set(row["systems"]) == {"agentserve", "fcfs"}
        for figs in row["systems"].values():
            assert figs["errors"] == 0 and figs["requests"] > 0
            assert figs["tpot_p95"] > 0 and figs["throughput_tok_s"] > 0 and 0 <= figs["slo_attainment"] <= 1
    assert png.is_file() and (tmp_path / "s-agents2.png").is_file()


def test_a_sigterm_stops_bench_as_ctrl_c_does():
    """A SIGTERM killed bench where it stood: its server was stopped (by the server's own watch of its parent) but
    its work and socket folders stayed in /tmp, and it exited -15 without a word."""
    import os
    import shutil
    import signal
    import tempfile
    import time

    tmp = Path(tempfile.mkdtemp(prefix="asb", dir="/tmp"))  # short: bench's ipc socket goes in it
    exe = Path(sys.executable).with_name("agentserve")
    cmd = [str(exe) if exe.is_file() else "agentserve", "bench", "--workload", "react", "--agents", "1",
           "--policies", "agentserve", "--duration", "120", "--model", "tiny", "--steps", "3"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "TMPDIR": str(tmp)})
    try:
        deadline = time.monotonic() + 180
        while not any("ready" in log.read_text() for log in tmp.glob("agentserve-bench-*/server.log")):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0][-3000:]
            time.sleep(0.2)
        time.sleep(1.0)  # agents running
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        left = list(tmp.glob("agentserve-bench*"))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        shutil.rmtree(tmp, ignore_errors=True)
    assert proc.returncode == 128 + signal.SIGTERM and "agentserve bench: terminated" in out, out[-3000:]
    assert "Traceback" not in out and not left, (left, out[-3000:])
