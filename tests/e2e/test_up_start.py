"""``agentserve up`` before it serves: bad flags are one clear error before anything starts, and signals during
the model load leave nothing behind however many arrive; a second signal during a slow clean-up forces it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import uuid

import pytest

from agentserve.shm.segment import pid_alive


def _up(*flags: str) -> tuple[int, str]:
    """``agentserve up`` expected to stop at once; one that starts serving instead is killed (then: -9)."""
    run = f"b{uuid.uuid4().hex[:6]}"
    proc = subprocess.Popen(["agentserve", "up", "--model", "tiny", "--run", run, *flags], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return proc.returncode, out


@pytest.mark.parametrize("flags, says", [
    (["--log-level", "bogus"], "--log-level"),
    (["--max-model-len", "-1"], "--max-model-len"),
    (["--num-blocks", "0"], "--num-blocks"),
    (["--kv-cache-gb", "0"], "--kv-cache-gb"),
    (["--run", "a/b"], "run name must match"),
    (["--endpoint", "tcp://127.0.0.1:99999"], "0-65535"),
    (["--num-blocks", "64", "--kv-cache-gb", "1"], "not both"),
    (["--tpot-slo-ms", "0"], "--tpot-slo-ms"),  # 0 was dropped without a word (-1 was refused)
    (["--ttft-slo-ms", "0"], "--ttft-slo-ms"),
])
def test_bad_flags_are_one_clear_error(flags, says) -> None:
    code, out = _up(*flags)
    assert code == 2 and says in out and "Traceback" not in out, out


@pytest.mark.parametrize("device", ["bogus", "cuda:-1"])
def test_doctor_on_a_device_that_cannot_be_is_one_clear_error(device) -> None:
    """The same rule for `agentserve doctor --device` (it printed torch's RuntimeError with a traceback)."""
    res = subprocess.run(["agentserve", "doctor", "--device", device], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--device" in res.stderr and len(res.stderr.splitlines()) == 1, res.stderr


def test_an_ipc_endpoint_in_a_missing_folder_is_one_clear_error_and_no_folder_is_made(tmp_path) -> None:
    """`up` made the folder and every missing parent without a word, and served there."""
    code, out = _up("--endpoint", f"ipc://{tmp_path}/missing/dir/up.sock")
    assert code == 2 and f"agentserve up: cannot bind ipc://{tmp_path}/missing/dir/up.sock: the folder" in out, out
    assert "Traceback" not in out and not (tmp_path / "missing").exists()


def test_a_run_name_a_live_server_has_is_refused_by_name(tmp_path) -> None:
    """Another endpoint, the same --run: the segments would collide; it said only "shared-memory segment
    /agentserve-<run>-board already exists"."""
    from agentserve.protocol.stats import SNAPSHOT_VERSION
    from agentserve.shm.board import StatsBoard

    run = f"b{uuid.uuid4().hex[:6]}"
    with StatsBoard.create(run, 4096, SNAPSHOT_VERSION):  # this process plays the live server of `run`
        code, out = _up("--run", run, "--endpoint", f"ipc://{tmp_path}/other.sock")
    assert code == 2 and f"run '{run}' is already being served" in out and "Traceback" not in out, out


def test_an_http_port_in_use_is_refused_before_the_model_loads() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out = _up("--http", f"127.0.0.1:{port}")
    assert code == 2 and f"--http 127.0.0.1:{port}" in out and "loading the model" not in out, out


def test_signals_in_quick_succession_during_the_load_leave_nothing(tmp_path) -> None:
    """The second signal arrived while the first one's clean-up ran and cut it short: the socket file stayed.
    Now it forces the clean-up (exit 130) if that is still running, and leaves nothing either way."""
    run = f"s{uuid.uuid4().hex[:6]}"
    sock = tmp_path / "up.sock"
    proc = subprocess.Popen(["agentserve", "up", "--model", "tiny", "--run", run, "--endpoint", f"ipc://{sock}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not sock.exists():  # the ingress binds before the model loads
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else "slow"
        time.sleep(0.01)
    time.sleep(0.3)  # the executor is starting
    proc.send_signal(signal.SIGINT)
    time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) in (0, 130), proc.stderr.read()
    assert not sock.exists()
    assert not [n for n in os.listdir("/dev/shm") if run in n]
    assert subprocess.run(["pgrep", "-f", run], capture_output=True).returncode == 1, "a process was left"


@pytest.mark.parametrize("attempt", range(3))
def test_a_sigterm_the_moment_the_socket_exists_leaves_nothing(tmp_path, attempt) -> None:
    """Between binding the socket and installing its handlers `up` died of a SIGTERM (exit -15) and left the
    socket: a fleet SIGKILLed while its workers started left theirs (their parent-death signal is SIGTERM)."""
    run = f"t{uuid.uuid4().hex[:6]}"
    sock = tmp_path / "up.sock"
    proc = subprocess.Popen(["agentserve", "up", "--model", "tiny", "--run", run, "--endpoint", f"ipc://{sock}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not sock.exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else "slow"
        time.sleep(0.0005)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, proc.stderr.read()
    assert not sock.exists()
    assert not [n for n in os.listdir("/dev/shm") if run in n]


def test_a_second_signal_during_a_slow_clean_up_forces_it_and_leaves_nothing(tmp_path) -> None:
    """A stopped executor does not answer the Shutdown: the clean-up waited 10 s for it before killing it, and a
    second Ctrl-C did nothing meanwhile.  Now it kills the executor and the gateway and still removes everything."""
    run, sock = f"f{uuid.uuid4().hex[:6]}", tmp_path / "up.sock"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(["agentserve", "up", "--model", "tiny", "--run", run, "--endpoint", f"ipc://{sock}",
                             "--http", f"127.0.0.1:{port}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children: list[int] = []
    try:
        assert proc.stdout.readline().startswith("AgentServe ready"), proc.stderr.read() if proc.poll() else ""
        children = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                                   text=True).stdout.split()]  # the executor and the gateway
        assert len(children) == 2, children
        os.kill(next(p for p in children if b"agentserve.executor" in _cmdline(p)), signal.SIGSTOP)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        code, took = proc.wait(timeout=60), time.monotonic() - t0
    finally:
        if proc.poll() is None:  # it failed: leave no stopped executor behind
            subprocess.run(["pkill", "-KILL", "-P", str(proc.pid)])
            proc.kill()
        err = proc.communicate()[1]
    assert code == 130 and took < 5, (code, took, err)
    assert len([line for line in err.splitlines() if "forcing" in line]) == 1, err
    assert "shut down cleanly" not in err, err  # logged as the loop ended, before a clean-up that was then forced
    assert not sock.exists() and not [n for n in os.listdir("/dev/shm") if run in n]
    deadline = time.monotonic() + 5
    while any(pid_alive(p) for p in children):
        assert time.monotonic() < deadline, "a child was left running"
        time.sleep(0.05)


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


def _kill_if_running(proc: subprocess.Popen) -> None:
    """A test's ``up`` that a failure left running: killed and reaped."""
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def _ready_then_signal(*flags: str, sig: signal.Signals = signal.SIGINT, times: int = 1,
                       hangup_ignored: bool = False) -> str:
    """``agentserve up --model tiny`` until its ready line, then ``sig`` (``times`` times, 1 ms apart; killed if it
    does not stop); its stderr.  It must have served, stopped cleanly (exit 0) and left no segment and no process.
    ``hangup_ignored``: started as ``nohup`` starts it, and SIGTERM sent 1 s after ``sig``."""
    run = f"r{uuid.uuid4().hex[:6]}"
    # as nohup starts it, or as a terminal does: not whatever this process inherited (pytest under nohup ignores it)
    hangup = signal.SIG_IGN if hangup_ignored else signal.SIG_DFL
    proc = subprocess.Popen(["agentserve", "up", "--model", "tiny", "--run", run, *flags], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(signal.SIGHUP, hangup))
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(line.startswith("AgentServe ready") for line in lines):
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
        for _ in range(times):
            proc.send_signal(sig)
            time.sleep(0.001)
        if hangup_ignored:
            time.sleep(1.0)
            assert proc.poll() is None, "it stopped on a hangup it was started to ignore"
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        _kill_if_running(proc)
    assert any(line.startswith("AgentServe ready") for line in lines), (lines, err)
    assert proc.returncode == 0, (proc.returncode, err)
    assert not [n for n in os.listdir("/dev/shm") if run in n]
    assert subprocess.run(["pgrep", "-f", run], capture_output=True).returncode == 1, "a process was left"
    return err


def test_sighup_stops_it_cleanly_as_sigterm_does(tmp_path) -> None:
    """A closed terminal or a dropped ssh session (SIGHUP) killed it without its clean-up: no gateway or executor
    stop, segments and the socket left behind.  It is now a stop like SIGTERM's."""
    sock = tmp_path / "up.sock"
    err = _ready_then_signal("--endpoint", f"ipc://{sock}", sig=signal.SIGHUP)
    assert "received SIGHUP; stopping" in err and "shut down cleanly" in err, err
    assert not sock.exists()


def test_a_terminals_repeated_hangup_does_not_force_the_clean_up() -> None:
    """A closed terminal sends SIGHUP twice at once (the shell to its jobs, the kernel to the foreground group):
    the second one forced the clean-up (SIGKILL to the executor, exit 129) instead of letting it run."""
    err = _ready_then_signal(sig=signal.SIGHUP, times=2)
    assert "forcing" not in err and "shut down cleanly" in err, err


def test_under_nohup_a_hangup_is_ignored() -> None:
    """``nohup agentserve up &`` asks it to outlive the terminal: SIGHUP stopped it all the same."""
    err = _ready_then_signal(sig=signal.SIGHUP, hangup_ignored=True)
    assert "received SIGHUP" not in err and "received SIGTERM; stopping" in err, err


def test_a_stdout_nobody_reads_does_not_stop_the_server(tmp_path) -> None:
    """``agentserve up | head -1``, or stdout on a full disk: writing the ready line failed after the model had
    loaded and the server exited 1 (a closed pipe: without a word).  It serves, with the line in its log."""
    from agentserve.client import AgentClient

    sock = tmp_path / "up.sock"
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody will ever read its stdout
    proc = subprocess.Popen(["agentserve", "up", "--model", "tiny", "--run", f"p{uuid.uuid4().hex[:6]}",
                             "--endpoint", f"ipc://{sock}"], stdout=write_end, stderr=subprocess.PIPE, text=True)
    os.close(write_end)
    try:
        deadline = time.monotonic() + 120
        line = ""
        while time.monotonic() < deadline and "AgentServe ready" not in line:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, proc.returncode
        assert "stdout cannot be written" in line, line
        with AgentClient(f"ipc://{sock}") as client, client.session() as s:
            assert s.turn(token_ids=[5, 6], max_tokens=3, ignore_eos=True).collect().usage.completion_tokens == 3
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        _kill_if_running(proc)
    assert proc.returncode == 0 and "shut down cleanly" in err, (proc.returncode, err)


def test_with_log_json_every_line_on_stderr_is_json() -> None:
    """The "loading the model … N s" progress was a plain line among the JSON records."""
    import json

    err = _ready_then_signal("--log-json")
    records = [json.loads(line) for line in err.splitlines() if line.strip()]  # raises on a plain line
    assert any("loading the model" in r.get("msg", r.get("message", "")) for r in records), err


def test_a_max_model_len_over_the_models_context_is_served_with_a_warning_naming_both() -> None:
    """It started and served the model's 4096 tokens without a word about the 100000 asked for."""
    err = _ready_then_signal("--max-model-len", "100000")
    warning = next((line for line in err.splitlines() if "level=WARNING" in line and "max_model_len" in line), "")
    assert "100000" in warning and "4096" in warning, err
