"""`agentserve bench` without an AgentServe server: --target against a fake server, and the launchers."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bench_fakes import FakeDriver, FakeLaunches, ThreadedServer
from click.testing import CliRunner

from agentserve.bench import runner, servers
from agentserve.bench.workload import load_spec
from agentserve.cli.bench import bench, context_per_agent
from agentserve.shm.segment import pid_alive


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


def test_a_sweep_writes_a_row_per_agent_count_and_both_figures(tmp_path):
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    with ThreadedServer() as fake:
        result = CliRunner().invoke(bench, [
            "--target", fake.url, "--agents", "1,2", "--repeats", "2", "--duration", "0.6",
            "--tool-latency-median", "0.05", "--steps", "2", "--json", str(out), "--plot", str(png),
        ])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["meta"]["agents"] == [1, 2] and [r["agents"] for r in data["rows"]] == [1, 2]
    for row in data["rows"]:
        figs = row["systems"]["target"]
        for key in ("slo_attainment", "ttft_slo_attainment", "tpot_slo_attainment", "goodput", "ttft_p95",
                    "ttft_cold_p50", "ttft_cold_p95", "ttft_resume_p50", "ttft_resume_p95", "tpot_p95",
                    "throughput_tok_s"):
            assert figs[key] is not None, key
        assert figs["requests"] > 0 and figs["ratios"]["tpot_p95"] == 1.0
    assert [p["meta"]["agents"] for p in data["points"]] == [1, 2]
    assert data["points"][1]["policies"]["target"]["elapsed_s"] >= 1.2  # both repeats pooled
    assert "--agents 1,2" in data["meta"]["command"] and "--repeats 2" in data["meta"]["command"]
    assert data["meta"]["plots"] == {"sweep": "s.png", "agents2": "s-agents2.png"}
    for path in (png, tmp_path / "s-agents2.png"):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "sweep: 4/4 runs" in result.output and "left" in result.output
    assert "2 agents · target (2/2)" in result.output
    assert data["meta"]["cpu_flags"] is not None and "cpu_model" in data["meta"]
    assert data["meta"]["date"] < data["meta"]["finished"]  # began before the runs, finished after
    assert len(data["meta"]["loadavg_1_5_15"]) == 3 and len(data["meta"]["loadavg_end"]) == 3


def _fake_targets(launches: FakeLaunches):
    def launcher(model, server_args, *args, **kwargs):
        def launch(name, spec):
            @contextlib.contextmanager
            def target():
                with launches(name, spec):
                    yield servers.Target(name, lambda: FakeDriver(token_s=0.0005))
            return target()
        return launch
    return launcher


def test_a_policy_sweep_starts_each_system_fresh_at_each_count_in_order(tmp_path, monkeypatch):
    launches = FakeLaunches(fail={("llama-server", 2): None})
    monkeypatch.setattr(runner, "launcher", _fake_targets(launches))
    out = tmp_path / "s.json"
    result = CliRunner().invoke(bench, [
        "--policies", "agentserve,no-feedback,llama-server", "--agents", "1,2", "--duration", "0.3",
        "--tool-latency-median", "0.02", "--steps", "2", "--seed", "5", "--json", str(out),
    ])
    assert result.exit_code != 0 and "llama-server" in result.output  # a failed system fails the command
    assert [e[:4] for e in launches.log if e[0] != "stop"] == [
        ("start", "agentserve", 1, 5), ("start", "no-feedback", 1, 5), ("start", "llama-server", 1, 5),
        ("start", "agentserve", 2, 5), ("start", "no-feedback", 2, 5), ("refused", "llama-server", 2, 5)]
    data = json.loads(out.read_text())  # written all the same, with the failure recorded
    assert data["meta"]["failed"] == {"2": ["llama-server"]}
    assert list(data["rows"][1]["systems"]) == ["agentserve", "no-feedback"]
    assert data["systems"] == ["agentserve", "no-feedback", "llama-server"]


def test_bad_policy_or_agent_list_is_refused_before_anything_runs():
    result = CliRunner().invoke(bench, ["--policies", "agentserve,vllm"])
    assert result.exit_code == 2 and "vllm" in result.output and "no-partition" in result.output
    result = CliRunner().invoke(bench, ["--agents", "1,0"])
    assert result.exit_code == 2 and "--agents" in result.output


@pytest.mark.parametrize("args, says", [
    (["--duration", "nan"], "--duration"), (["--duration", "inf"], "--duration"), (["--duration", "0"], "--duration"),
    (["--warmup", "-3"], "--warmup"), (["--request-timeout", "0"], "--request-timeout"),
    (["--ttft-slo-ms", "nan"], "--ttft-slo-ms"), (["--tool-latency-sigma", "-1"], "--tool-latency-sigma"),
    (["--steps", "0"], "--steps"), (["--workload", "nosuch"], "--workload"),
    (["--json", "/nonexistent/dir/x.json"], "--json"), (["--plot", "/nonexistent/dir/x.png"], "--plot"),
])
def test_bad_values_are_a_usage_error_before_anything_runs(args, says, monkeypatch):
    """nan and inf were tracebacks, 0 and negatives ran for nothing (or started a server first), a bad workload was
    a traceback, and a --json / --plot into a missing folder failed after every run, losing its results."""
    monkeypatch.setattr(runner, "launcher", lambda *a, **k: pytest.fail("a run started"))
    result = CliRunner().invoke(bench, ["--target", "http://127.0.0.1:9", *args])
    assert result.exit_code == 2 and says in result.output and result.exception.__class__ is SystemExit, \
        result.output


def test_bench_gives_its_caller_back_its_sigterm_handler():
    """bench turns SIGTERM into an interrupt while it runs; a caller in the same process (CliRunner, a script) keeps
    its own handler afterwards."""
    before = signal.getsignal(signal.SIGTERM)
    result = CliRunner().invoke(bench, ["--target", "http://127.0.0.1:9", "--workload", "nosuch"])  # past the install
    assert result.exit_code == 2 and signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("toml, says", [
    ("[workload]\nname = 'x'\n", "the workload has no 'steps_per_task'"),
    ("[workload\n", "--workload"),
    (Path(__file__).parents[2].joinpath("configs/workloads/react.toml").read_text().replace(
        "steps_per_task = 8", 'steps_per_task = "two"'), "--workload"),
])
def test_a_bad_workload_file_is_a_usage_error(tmp_path, toml, says):
    path = tmp_path / "w.toml"
    path.write_text(toml)
    result = CliRunner().invoke(bench, ["--target", "http://127.0.0.1:9", "--workload", str(path)])
    assert result.exit_code == 2 and says in result.output and "Traceback" not in result.output, result.output


def test_each_point_launches_its_system_for_that_agent_count(monkeypatch):
    calls = []
    monkeypatch.setattr(servers, "llama_server", lambda *a, **k: calls.append(("llama", *a, k)))
    monkeypatch.setattr(servers, "agentserve", lambda *a, **k: calls.append(("up", *a, k)))
    launch = runner.launcher("tiny", ["--tpot-slo-ms", "80"])
    spec = dataclasses.replace(load_spec("react"), agents=5)
    launch("llama-server", spec)
    launch("no-partition", spec)
    assert calls == [("llama", "tiny", 5, context_per_agent(spec), {"keep_log": None}),
                     ("up", "tiny", "no-partition", ["--tpot-slo-ms", "80"], {"keep_log": None})]
    calls.clear()
    runner.launcher("tiny", [], logs=Path("logs"))("agentserve", spec)
    assert calls == [("up", "tiny", "agentserve", [], {"keep_log": Path("logs/react-agentserve-agents5-seed0.log")})]
    with pytest.raises(ValueError, match="--target"):
        launch("target", spec)


def test_a_kept_log_is_the_servers_whole_output_after_it_stopped(tmp_path):
    """``--keep-logs``: the log is copied once the server has stopped (its last lines included), into a folder made
    as needed; the server's own work folder still goes."""
    keep = tmp_path / "kept" / "x.log"
    cmd = [sys.executable, "-c", "import signal, sys, time\n"
           "signal.signal(signal.SIGTERM, lambda *a: (print('stopping cleanly', flush=True), sys.exit(0)))\n"
           "print('ready', flush=True)\ntime.sleep(60)"]
    with servers._process(cmd, lambda proc, log: "ready" in log.read_text(), 30, keep_log=keep) as proc:
        assert not keep.exists(), "kept only once the server has stopped"
    assert proc.returncode == 0
    assert keep.read_text().split() == ["ready", "stopping", "cleanly"]
    again = tmp_path / "again.log"
    again.write_text("a later server")
    assert servers.keep(again, keep) == keep.with_name("x-2.log"), "an earlier log is never overwritten"
    assert keep.read_text().split()[0] == "ready" and keep.with_name("x-2.log").read_text() == "a later server"


def test_a_system_whose_replies_stop_short_fails_the_command(tmp_path, monkeypatch):
    """Every turn asks for ignore_eos: a system that stops early did less work, so its figures do not compare."""
    def launcher(name, spec, *args, **kwargs):
        @contextlib.contextmanager
        def target():
            yield servers.Target(name, lambda: FakeDriver(token_s=0.0005, short_by=1 if name == "fcfs" else 0))
        return target()

    monkeypatch.setattr(runner, "launcher", lambda *a, **k: launcher)
    out = tmp_path / "s.json"
    result = CliRunner().invoke(bench, ["--policies", "agentserve,fcfs", "--duration", "0.3", "--agents", "1",
                                        "--tool-latency-median", "0.02", "--steps", "2", "--json", str(out)])
    assert result.exit_code != 0 and "stopped short" in result.output and "fcfs @ 1" in result.output
    policies = json.loads(out.read_text())["policies"]
    assert policies["fcfs"]["short_replies"] == policies["fcfs"]["requests"] > 0
    assert policies["agentserve"]["short_replies"] == 0
    assert "short)" in result.output


SIGNAL_LOGGER = ("import os, signal, sys, time\n"
                 "heard = open(sys.argv[1], 'a')\n"
                 "def on(sig, frame):\n"
                 "    heard.write(signal.Signals(sig).name + '\\n'); heard.flush()\n"
                 "    if sig == signal.SIGTERM: sys.exit(0)\n"
                 "signal.signal(signal.SIGINT, on); signal.signal(signal.SIGTERM, on)\n"
                 "heard.write(f'pid {os.getpid()}\\n'); heard.flush()\n"
                 "print('ready', flush=True)\n"
                 "while True: time.sleep(1)\n")

BENCH_LIKE = ("import sys, time\n"
              "from agentserve.bench import servers\n"
              "cmd = [sys.executable, '-c', sys.argv[1], sys.argv[2]]\n"
              "with servers._process(cmd, lambda proc, log: 'ready' in log.read_text(), 30):\n"
              "    print('serving', flush=True); time.sleep(120)\n")


@pytest.mark.parametrize("how", ["ctrl-c", "killed"])
def test_the_server_is_stopped_by_bench_alone(tmp_path, how):
    """The server shared the terminal's process group: a Ctrl-C reached it as well as bench, which then sent SIGTERM
    to a server already stopping (`agentserve up` took that as a second signal: 'exited with 143').  It has its own
    session now, so only bench's SIGTERM reaches it; and a bench that dies without stopping it (SIGKILL, a closed
    terminal) takes it along, with a SIGTERM, instead of leaving it running."""
    heard = tmp_path / "heard"
    # a killed bench cannot remove its server's work folder: make that under tmp_path, not in the machine's /tmp
    bench_proc = subprocess.Popen([sys.executable, "-c", BENCH_LIKE, SIGNAL_LOGGER, str(heard)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "TMPDIR": str(tmp_path)},
                                  start_new_session=True)  # a terminal's process group, of its own
    try:
        assert bench_proc.stdout.readline() == "serving\n", bench_proc.stderr.read()
        if how == "ctrl-c":
            os.killpg(bench_proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        else:
            bench_proc.kill()
        _, err = bench_proc.communicate(timeout=60)
        server_pid = int(heard.read_text().split()[1])
        deadline = time.monotonic() + 60
        while pid_alive(server_pid):
            assert time.monotonic() < deadline, "the server was left running"
            time.sleep(0.05)
    finally:  # whatever failed: nothing left running
        with contextlib.suppress(ProcessLookupError):
            os.killpg(bench_proc.pid, signal.SIGKILL)
        with contextlib.suppress(OSError, ValueError, IndexError):
            os.kill(int(heard.read_text().split()[1]), signal.SIGKILL)
    assert heard.read_text().split()[2:] == ["SIGTERM"], heard.read_text()
    assert "warning" not in err, err
