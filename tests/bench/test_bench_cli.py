"""`agentserve bench` without an AgentServe server: --target against a fake server, and the launchers."""

from __future__ import annotations

import json
import sys

import pytest
from bench_fakes import ThreadedServer
from click.testing import CliRunner

from agentserve.bench import servers
from agentserve.bench.workload import load_spec
from agentserve.cli.bench import bench, context_per_agent


def test_bench_against_an_external_server_writes_json(tmp_path):
    out = tmp_path / "out.json"
    with ThreadedServer() as fake:
        result = CliRunner().invoke(bench, [
            "--target", fake.url, "--workload", "react", "--agents", "2", "--duration", "1.5", "--warmup", "0.3",
            "--tool-latency-median", "0.05", "--steps", "2", "--json", str(out), "--tpot-slo-ms", "1000",
        ])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    figs = data["policies"]["target"]
    assert figs["requests"] > 0 and figs["errors"] == 0
    assert figs["tpot"]["p95"] > 0 and figs["throughput_tok_s"] > 0
    assert data["meta"]["agents"] == 2 and data["meta"]["steps_per_task"] == 2
    assert data["meta"]["warmup_s"] == 0.3 and figs["elapsed_s"] >= 1.5
    # every request resent the growing conversation as token ids
    assert all(isinstance(b["prompt"], list) for b in fake.bodies)
    assert "TPOT p95" in result.output


def test_bench_repeats_pool_every_run_and_list_each_repeats_ratios(tmp_path):
    out = tmp_path / "out.json"
    with ThreadedServer() as fake:
        result = CliRunner().invoke(bench, [
            "--target", fake.url, "--agents", "1", "--duration", "0.8", "--repeats", "2",
            "--tool-latency-median", "0.05", "--steps", "2", "--json", str(out),
        ])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    figs = data["policies"]["target"]
    assert data["meta"]["repeats"] == 2 and len(data["meta"]["per_repeat_ratios"]) == 2
    assert data["meta"]["per_repeat_ratios"][1]["target"]["throughput_tok_s"] == 1.0  # its own reference
    assert figs["elapsed_s"] >= 1.6  # both runs, end to end
    # repeat 2 runs seed + 1: its agent's first prompt differs from repeat 1's
    firsts = [b["prompt"] for b in fake.bodies if len(b["prompt"]) > 2000]
    assert len(firsts) >= 2 and firsts[0] != firsts[-1]
    assert "target (2/2)" in result.output
    bad = CliRunner().invoke(bench, ["--target", "http://127.0.0.1:9", "--repeats", "0"])
    assert bad.exit_code != 0 and "--repeats" in bad.output


def test_bench_fails_loudly_when_the_target_errors():
    with ThreadedServer(status=400) as fake:
        result = CliRunner().invoke(bench, ["--target", fake.url, "--duration", "1", "--agents", "1"])
    assert result.exit_code != 0
    assert "errors" in result.output


def _fake_up(script: str):
    return lambda model, policy, endpoint, extra: [sys.executable, "-c", script, endpoint]


def test_agentserve_launcher_waits_for_the_endpoint_and_stops_the_server(monkeypatch):
    script = ("import signal, sys, time\n"
              "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
              "time.sleep(0.3); print('listening on', sys.argv[1], flush=True)\n"
              "time.sleep(0.3); print('ready on', sys.argv[1], flush=True)\n"
              "while True: time.sleep(1)\n")
    monkeypatch.setattr(servers, "agentserve_command", _fake_up(script))
    with servers.agentserve("tiny", "fcfs", timeout_s=20) as target:
        driver = target.make_driver()
        assert target.name == "fcfs" and driver.endpoint.startswith("ipc://")


def test_agentserve_launcher_reports_a_server_that_dies(monkeypatch):
    monkeypatch.setattr(servers, "agentserve_command", _fake_up("print('no GPU'); raise SystemExit(3)"))
    launch = servers.agentserve("tiny", "x", timeout_s=20)
    with pytest.raises(servers.ServerFailed, match="no GPU"), launch:
        pass


def test_llama_context_fits_the_longest_task():
    spec = load_spec("plan-execute")
    assert context_per_agent(spec) >= 3500 + 5 * 421 + 6 * 64
    assert context_per_agent(spec) % 256 == 0
