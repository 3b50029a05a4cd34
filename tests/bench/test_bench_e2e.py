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
