"""``agentserve fleet up``'s pieces that need no processes: settings precedence, the router's command line,
the ready line, and the errors for a missing router or a non-loopback host."""

from __future__ import annotations

import http.server
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from agentserve.cli import fleet as fleet_cli
from agentserve.cli.fleet import READY, _settings, parse_ready_line
from agentserve.cli.fleet_members import make_worker, router_command
from agentserve.protocol.endpoints import EndpointError

NO_FLAGS = {"config_file": None, "workers": None, "model": None, "host": None, "port": None,
            "worker_base_port": None, "metrics_port": None, "name": None, "policy": None, "allow_remote": False}


def test_packaged_settings_then_file_then_environment_then_flags(tmp_path, monkeypatch) -> None:
    defaults = _settings(NO_FLAGS)
    assert defaults["fleet"]["workers"] == 2 and defaults["router"]["policy"] == "cache_aware"
    assert defaults["router"]["cache_threshold"] == 0.9
    config = tmp_path / "fleet.toml"
    config.write_text("[fleet]\nworkers = 3\nname = \"f\"\n[router]\ncache_threshold = 0.8\n")
    monkeypatch.setenv("AGENTSERVE_FLEET_NAME", "from-env")
    merged = _settings({**NO_FLAGS, "config_file": str(config), "policy": "round_robin", "port": 0})
    assert merged["fleet"]["workers"] == 3 and merged["fleet"]["name"] == "from-env"
    assert merged["fleet"]["router_port"] == 0
    assert merged["router"] == {**defaults["router"], "cache_threshold": 0.8, "policy": "round_robin"}


def test_a_non_loopback_host_needs_allow_remote() -> None:
    with pytest.raises(EndpointError):
        _settings({**NO_FLAGS, "host": "0.0.0.0"})
    assert _settings({**NO_FLAGS, "host": "0.0.0.0", "allow_remote": True})["fleet"]["host"] == "0.0.0.0"


@pytest.mark.parametrize("name", ["a/b", "a b", "x" * 70])
def test_a_fleet_name_its_workers_cannot_run_under_is_refused_before_anything_starts(name) -> None:
    with pytest.raises(ValueError, match="run name must match") as e:
        _settings({**NO_FLAGS, "name": name})
    assert f"{name}-w" not in str(e.value)  # the name as given, not a worker's run name the user never typed


def test_a_fleet_name_too_long_only_for_its_workers_says_so() -> None:
    with pytest.raises(ValueError, match="too long for its workers' run names"):
        _settings({**NO_FLAGS, "name": "x" * 63})


def test_every_router_setting_becomes_a_flag() -> None:
    cmd = router_command(["http://127.0.0.1:1", "http://127.0.0.1:2"], "127.0.0.1", 30000, 29000,
                         {"policy": "cache_aware", "cache_threshold": 0.9, "dp_aware": True, "disable_retries": False},
                         ["--log-level", "debug"])
    assert cmd[:3] == [sys.executable, "-m", "sglang_router.launch_router"]
    assert cmd[3:6] == ["--worker-urls", "http://127.0.0.1:1", "http://127.0.0.1:2"]
    tail = cmd[cmd.index("--prometheus-port") + 2:]
    assert tail == ["--policy", "cache_aware", "--cache-threshold", "0.9", "--dp-aware", "--log-level", "debug"]


def test_each_worker_has_its_own_run_socket_and_port(tmp_path) -> None:
    workers = [make_worker(i, "f", "tiny", "127.0.0.1", 9000 + i, ["--dtype", "float32"], tmp_path) for i in (0, 1)]
    assert [w.run for w in workers] == ["f-w0", "f-w1"]
    assert len({w.endpoint for w in workers}) == 2 and all("f-w" in w.endpoint for w in workers)
    assert [w.url for w in workers] == ["http://127.0.0.1:9000", "http://127.0.0.1:9001"]
    assert workers[1].command[-4:] == ["--http", "127.0.0.1:9001", "--dtype", "float32"]


def test_the_ready_line_parses_back() -> None:
    line = (f"{READY}http://127.0.0.1:30000 · policy round_robin · 2 workers http://127.0.0.1:30001 "
            "http://127.0.0.1:30002 · model tiny · router metrics http://127.0.0.1:29000/metrics · logs /tmp/x\n")
    assert parse_ready_line(line) == {
        "router": "http://127.0.0.1:30000", "workers": ["http://127.0.0.1:30001", "http://127.0.0.1:30002"],
        "policy": "round_robin", "metrics": "http://127.0.0.1:29000/metrics", "logs": "/tmp/x"}
    with pytest.raises(ValueError):
        parse_ready_line("AgentServe ready on ipc://x")


def test_without_the_router_installed_fleet_up_says_what_to_install(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(fleet_cli.importlib.util, "find_spec",
                        lambda name, *a: None if name == "sglang_router" else real(name, *a))
    result = CliRunner().invoke(fleet_cli.fleet, ["up", "--workers", "2"])
    assert result.exit_code != 0 and "agentserve[fleet]" in result.output


def test_clean_up_removes_a_dead_workers_socket_but_not_a_live_one(tmp_path) -> None:
    import socket

    worker = make_worker(0, "f", "tiny", "127.0.0.1", 9000, [], tmp_path)
    worker.endpoint = f"ipc://{tmp_path}/w0.sock"
    live = socket.socket(socket.AF_UNIX)
    live.bind(str(tmp_path / "w0.sock"))
    live.listen()
    assert worker.clean_up() == [] and (tmp_path / "w0.sock").exists()  # a worker restarted by hand
    live.close()  # the file stays, nobody listens: what a SIGKILLed `up` leaves
    assert worker.clean_up() == [str(tmp_path / "w0.sock")] and not (tmp_path / "w0.sock").exists()


class _StandIn(http.server.BaseHTTPRequestHandler):
    """Any program on a worker's port: 200 to every GET, with the body ``server.answers`` holds for its path."""

    def do_GET(self) -> None:  # noqa: N802 - the handler's name
        body = self.server.answers.get(self.path, b"ok")  # type: ignore[attr-defined]
        key = self.server.key  # type: ignore[attr-defined]
        if key and self.path != "/health" and self.headers.get("Authorization") != f"Bearer {key}":
            body = b'{"error": {"code": "invalid_api_key"}}'
            self.send_response(401)
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def stand_in():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)
    server.answers = {}
    server.key = ""  # with one: 401 without it but on /health, as an `up --api-key` gateway
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _info(run: str, model: str, server: str = "agentserve") -> bytes:
    return json.dumps({"server": server, "run": run, "served_model_name": model, "model_path": "/m"}).encode()


@pytest.mark.parametrize("server_info, ours", [
    (None, False),  # 200 "ok" to everything: it was taken for the worker, and the router would route to it
    (b"{}", False),
    (_info("f-w0", "tiny", server="sglang"), False),  # another server's /server_info
    (_info("other", "tiny"), False),  # an AgentServe server of another run
    (_info("f-w0", "bench"), False),  # ... serving another model
    (_info("f-w0", "tiny"), True),
])
def test_a_worker_is_ready_only_when_the_answer_is_from_this_worker(stand_in, server_info, ours, tmp_path) -> None:
    if server_info is not None:
        stand_in.answers["/server_info"] = server_info
    worker = make_worker(0, "f", "tiny", "127.0.0.1", stand_in.server_address[1], [], tmp_path)
    assert worker.healthy() is ours


def test_a_worker_serving_under_another_name_is_expected_under_it(stand_in, tmp_path) -> None:
    stand_in.answers["/server_info"] = _info("f-w0", "served")
    port = stand_in.server_address[1]
    for extra in (["--served-model-name", "served"], ["--served-model-name=x", "--served-model-name=served"]):
        assert make_worker(0, "f", "tiny", "127.0.0.1", port, extra, tmp_path).healthy(), extra
    assert not make_worker(0, "f", "tiny", "127.0.0.1", port, [], tmp_path).healthy()


def test_a_worker_with_an_api_key_is_asked_with_it(stand_in, tmp_path, monkeypatch) -> None:
    """A worker's gateway wants its key on /server_info: the one `--server-arg=--api-key` gives it (the last, as
    `up` reads its flags; it wins over the environment's) or else the AGENTSERVE_API_KEY it inherits.  Only the
    environment's was sent, so a fleet whose workers got the key as a server argument never became ready."""
    stand_in.answers["/server_info"] = _info("f-w0", "tiny")
    stand_in.key = "sk-w"
    port = stand_in.server_address[1]
    monkeypatch.delenv("AGENTSERVE_API_KEY", raising=False)
    for extra in (["--api-key", "sk-w"], ["--api-key=x", "--api-key=sk-w"]):
        assert make_worker(0, "f", "tiny", "127.0.0.1", port, extra, tmp_path).healthy(), extra
    assert not make_worker(0, "f", "tiny", "127.0.0.1", port, [], tmp_path).healthy()  # no key: 401
    monkeypatch.setenv("AGENTSERVE_API_KEY", "sk-w")
    assert make_worker(0, "f", "tiny", "127.0.0.1", port, [], tmp_path).healthy()
    assert not make_worker(0, "f", "tiny", "127.0.0.1", port, ["--api-key", "other"], tmp_path).healthy()
    assert "sk-w" not in repr(make_worker(0, "f", "tiny", "127.0.0.1", port, [], tmp_path))


# ---- bad input to `fleet up` is one line and exit 2, before any member starts ------------------------------------

def _start(name: str, *flags: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(["agentserve", "fleet", "up", "--model", "tiny", "--name", name, *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)


def _members_gone(name: str) -> None:
    deadline = time.monotonic() + 30
    while subprocess.run(["pgrep", "-f", f"--run {name}-"], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, "a worker was left running"
        time.sleep(0.2)
    assert not [n for n in os.listdir("/dev/shm") if name in n]


def _fleet_up(*flags: str, env: dict[str, str] | None = None) -> tuple[int, str, float]:
    """``agentserve fleet up`` expected to stop at once: (exit code, stderr, seconds); one that starts is killed."""
    name = f"fc{uuid.uuid4().hex[:6]}"
    t0 = time.monotonic()
    proc = _start(name, *flags, env=env)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()  # its members get SIGTERM with it (PDEATHSIG)
        _, err = proc.communicate()
    took = time.monotonic() - t0
    _members_gone(name)
    return proc.returncode, err, took


def _one_clear_line(code: int, err: str, says: str) -> None:
    assert code == 2 and says in err and "Traceback" not in err and len(err.strip().splitlines()) <= 4, err


@pytest.mark.parametrize("flags, says", [
    (["--name", "bad/name"], "'bad/name'"),  # was exit 1 and named 'bad/name-w1'
    (["--host", "0.0.0.0"], "--host '0.0.0.0'"),  # was exit 1, naming tcp://0.0.0.0:1
    (["--port", "99999"], "--port"),  # was an OverflowError traceback from the router, after the workers loaded
    (["--metrics-port", "-1"], "--metrics-port"),
    (["--worker-base-port", "65535", "--workers", "2"], "--worker-base-port 65535"),
    (["--port", "0", "--worker-base-port", "31000", "--metrics-port", "31001"], "same port"),
])
def test_bad_input_is_exit_2_before_anything_starts(flags, says) -> None:
    code, err, _ = _fleet_up(*flags)
    _one_clear_line(code, err, says)
    if "--name" in flags:
        assert "bad/name-w" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("flag", ["--port", "--metrics-port", "--worker-base-port"])
def test_a_taken_port_is_refused_before_any_worker_loads(flag) -> None:
    """A listener on the router's port: the fleet loaded every worker, then showed the router's traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = {"--port": "0", "--metrics-port": "0", "--worker-base-port": "0", flag: str(port)}
        code, err, took = _fleet_up(*[x for kv in ports.items() for x in kv])
    _one_clear_line(code, err, f"{flag} {port}")
    assert "in use" in err and len(err.strip().splitlines()) == 1 and took < 30, (took, err)


FREE_PORTS = ("--port", "0", "--worker-base-port", "0", "--metrics-port", "0")


def test_a_later_fleet_up_removes_the_log_folder_of_a_killed_one() -> None:
    """A SIGKILLed `fleet up` runs no clean-up: its temporary log folder stayed behind for good."""
    tmp = Path(tempfile.mkdtemp(prefix="fl"))  # the fleets' temporary folder (TMPDIR), short for the ipc sockets
    env = {**os.environ, "TMPDIR": str(tmp)}
    name = f"fk{uuid.uuid4().hex[:6]}"
    try:
        killed = _start(name, "--workers", "1", *FREE_PORTS, env=env)
        deadline = time.monotonic() + 60
        while not (left := list(tmp.glob(f"agentserve-{name}-*"))):
            assert time.monotonic() < deadline and killed.poll() is None, "no log folder"
            time.sleep(0.05)
        killed.kill()
        killed.communicate()
        _members_gone(name)
        assert left[0].is_dir()
        code, err, _ = _fleet_up("--workers", "1", *FREE_PORTS, "--server-arg=--log-level", "--server-arg=bogus",
                                 env=env)  # its worker exits at once: the fleet stops by itself
        assert code == 2 and "worker 0 exited" in err, err
        assert not [p.name for p in tmp.iterdir() if p.name.startswith("agentserve-")]  # nor its own folder
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
