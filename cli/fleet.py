"""``agentserve fleet up``: N AgentServe workers on this machine behind the SGLang Model Gateway.

Starts ``agentserve up --http`` N times (worker *i*: run ``<name>-w<i>``, its own ipc socket, shared-memory
names and HTTP port), waits for each to serve, starts ``sglang-router`` in front of them with the settings
of ``configs/fleet.toml`` (cache-aware routing by default), prints one ready line with the router's URL,
and on SIGTERM / SIGINT stops the router, then the workers, and removes anything a worker that died
left behind.  It restarts nothing: each ``up`` restarts its own executor, and a worker that exits is
reported with the command that brings it back on the same port (the router takes it back once its
health checks pass).  Settings: ``configs/fleet.toml`` < ``--config FILE`` < ``AGENTSERVE_FLEET_<KEY>`` /
``AGENTSERVE_ROUTER_<KEY>`` < flags.
"""

from __future__ import annotations

import importlib.util
import logging
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from agentserve import configs
from agentserve.cli.fleet_logs import make_log_dir, sweep_log_dirs
from agentserve.cli.fleet_members import Member, Router, Worker, make_worker, member_env, router_command
from agentserve.cli.gateway_process import check_free
from agentserve.configs.logging import LOG_LEVELS, setup_logging
from agentserve.protocol.endpoints import EndpointError, check_bind
from agentserve.shm.segment import check_run

log = logging.getLogger("agentserve.fleet")

POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")


READY = "AgentServe fleet ready: "


def parse_ready_line(line: str) -> dict[str, Any]:
    """The URLs in ``fleet up``'s ready line: ``router``, ``workers`` (a list), ``metrics``, ``logs``."""
    if not line.startswith(READY):
        raise ValueError(f"not the fleet's ready line: {line!r}")
    parts = line[len(READY):].strip().split(" · ")
    fields = {p.split(" ", 1)[0]: p.split(" ", 1)[1] for p in parts[1:]}
    workers = next(p for p in parts if " workers " in p).split(" workers ", 1)[1].split()
    return {"router": parts[0], "workers": workers, "policy": fields["policy"],
            "metrics": fields["router"].removeprefix("metrics "), "logs": fields["logs"]}


class FleetError(RuntimeError):
    """The fleet could not start (a member exited or did not get ready in time)."""


class Stopped(Exception):
    """SIGTERM / SIGINT arrived while starting."""


def load_settings(config_file: str | None) -> dict[str, Any]:
    return configs.load("fleet", config_file or None)


def free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


PORT = click.IntRange(0, 65535)
PORT_KEYS = {"router_port": "--port", "worker_base_port": "--worker-base-port", "metrics_port": "--metrics-port"}


def plan_ports(cfg: dict[str, Any]) -> tuple[list[int], int, int]:
    """(worker ports, router port, metrics port): each configured one checked free now, each 0 a free one.  A taken
    port used to fail only as its member started: the router's after every worker had loaded its model."""
    host, n = str(cfg["host"]), int(cfg["workers"])
    for key, flag in PORT_KEYS.items():
        if not 0 <= int(cfg[key]) <= 65535:
            raise ValueError(f"{flag} (or [fleet] {key}) must be in 0..65535, got {cfg[key]}")
    base = int(cfg["worker_base_port"])
    if base and base + n - 1 > 65535:
        raise ValueError(f"--worker-base-port {base} leaves no port for worker {65536 - base} of {n}")
    named = [(f"--worker-base-port {base} + {i} (worker {i})", base + i) for i in range(n)] if base else []
    named += [(f"{flag} {cfg[key]}", int(cfg[key]))
              for key, flag in PORT_KEYS.items() if key != "worker_base_port" and int(cfg[key])]
    seen: dict[int, str] = {}
    for what, port in named:
        if port in seen:
            raise ValueError(f"{what} is the same port as {seen[port]}")
        seen[port] = what
        check_free(host, port, what)
    workers = [base + i if base else free_port(host) for i in range(n)]
    router, metrics = (int(cfg[k]) or free_port(host) for k in ("router_port", "metrics_port"))
    return workers, router, metrics


@click.group("fleet")
def fleet() -> None:
    """Several AgentServe workers behind a router (the SGLang Model Gateway)."""


@fleet.command("up")
@click.option("--workers", type=click.IntRange(min=1), default=None, help="How many workers [fleet.toml: 2].")
@click.option("--model", default=None, help="Checkpoint folder or built-in model every worker serves.")
@click.option("--policy", type=click.Choice(POLICIES), default=None, help="The router's policy [cache_aware].")
@click.option("--host", default=None, help="Where the router and the workers listen [127.0.0.1].")
@click.option("--port", type=PORT, default=None, help="The router's port; 0 = any free port [30000].")
@click.option("--worker-base-port", type=PORT, default=None, help="Worker i listens on this + i; 0 = free ports.")
@click.option("--metrics-port", type=PORT, default=None, help="The router's Prometheus port; 0 = any free port.")
@click.option("--name", default=None, help="Run-name prefix of the workers [fleet].")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None,
              help="A TOML file with [fleet] and [router] sections.")
@click.option("--allow-remote", is_flag=True, help="Allow a non-loopback --host (router and workers).")
@click.option("--server-arg", "server_args", multiple=True, help="Extra argument for every `agentserve up`.")
@click.option("--router-arg", "router_args", multiple=True, help="Extra argument for the router.")
@click.option("--log-dir", type=click.Path(file_okay=False), default=None,
              help="Keep each member's output here (default: a temporary folder removed on exit).")
@click.option("--log-level", type=click.Choice(LOG_LEVELS, case_sensitive=False), default="INFO", show_default=True)
def up(**opts: Any) -> None:
    """Start N workers and the router; stop all of them on SIGTERM / SIGINT."""
    setup_logging(opts["log_level"])
    if importlib.util.find_spec("sglang_router") is None:
        raise click.ClickException("the router is not installed: pip install 'agentserve[fleet]' (sglang-router)")
    try:
        settings = _settings(opts)
        ports = plan_ports(settings["fleet"])  # before anything starts
    except (configs.ConfigError, EndpointError, ValueError) as e:
        click.echo(f"agentserve fleet up: {e}", err=True)  # bad input: one line, exit 2, as `agentserve up`
        sys.exit(2)
    sys.exit(Fleet(settings, opts, ports).run())


def _settings(opts: dict[str, Any]) -> dict[str, Any]:
    settings = load_settings(opts["config_file"])
    fleet_cfg, router_cfg = dict(settings["fleet"]), dict(settings["router"])
    flags = {"workers": "workers", "model": "model", "host": "host", "port": "router_port",
             "worker_base_port": "worker_base_port", "metrics_port": "metrics_port", "name": "name"}
    for flag, key in flags.items():
        if opts[flag] is not None:
            fleet_cfg[key] = opts[flag]
    if opts["policy"]:
        router_cfg["policy"] = opts["policy"]
    try:
        check_bind(f"tcp://{fleet_cfg['host']}:1", allow_remote=opts["allow_remote"])
    except EndpointError:  # its message names an endpoint the user never typed
        raise EndpointError(f"--host {fleet_cfg['host']!r} is not a loopback address and the workers have no "
                            "authentication: pass --allow-remote to serve it anyway") from None
    if int(fleet_cfg["workers"]) < 1:
        raise ValueError("[fleet] workers must be >= 1")
    name = str(fleet_cfg["name"])
    check_run(name)
    last = f"{name}-w{int(fleet_cfg['workers']) - 1}"  # the longest of the workers' run names
    try:
        check_run(last)
    except ValueError:
        raise ValueError(f"fleet name {name!r} is too long for its workers' run names ({last!r})") from None
    return {"fleet": fleet_cfg, "router": router_cfg}


class Fleet:
    def __init__(self, settings: dict[str, Any], opts: dict[str, Any], ports: tuple[list[int], int, int]) -> None:
        self.cfg, self.router_cfg = settings["fleet"], settings["router"]
        self.worker_ports, self.router_port, self.metrics_port = ports
        self.opts = opts
        self.keep_logs = opts["log_dir"] is not None
        sweep_log_dirs()  # what fleets killed before they could remove their own left
        self.log_dir = Path(opts["log_dir"]) if opts["log_dir"] else make_log_dir(str(self.cfg["name"]))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.stop_requested = threading.Event()
        self.workers: list[Worker] = []
        self.router: Router | None = None

    # ---- the whole life ----------------------------------------------------------------------
    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: self.stop_requested.set())
        try:
            self.start()
            self.announce()
            return self.watch()
        except FleetError as e:
            click.echo(f"agentserve fleet up: {e}", err=True)
            return 2
        except Stopped:
            log.info("stopped while starting")
            return 0
        finally:
            self.stop()

    def start(self) -> None:
        host, extra = self.cfg["host"], [*(["--allow-remote"] if self.opts["allow_remote"] else []),
                                         *self.opts["server_args"]]
        for i, port in enumerate(self.worker_ports):
            worker = make_worker(i, self.cfg["name"], str(self.cfg["model"]), host, port, extra, self.log_dir)
            worker.clean_up(socket=False)  # what a killed fleet of the same name left
            worker.start(member_env())
            self.workers.append(worker)
        self._wait(self.workers, lambda w: w.healthy(), float(self.cfg["worker_start_timeout_s"]), "serving")
        port, mport = self.router_port, self.metrics_port
        command = router_command([w.url for w in self.workers], host, port, mport, self.router_cfg,
                                 list(self.opts["router_args"]))
        bracketed = f"[{host}]" if ":" in host else host
        self.router = Router(name="router", command=command, log_path=self.log_dir / "router.log",
                             url=f"http://{bracketed}:{port}", metrics_url=f"http://{bracketed}:{mport}/metrics",
                             expected_workers=len(self.workers))
        self.router.start(member_env())
        self._wait([self.router], lambda r: r.ready(), float(self.cfg["router_start_timeout_s"]),
                   "routing to every worker")

    def _wait(self, members: list[Any], ready: Callable[[Any], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        pending = list(members)
        while pending:
            if self.stop_requested.is_set():
                raise Stopped
            for m in list(pending):
                if m.exit_code() is not None:
                    raise FleetError(f"{m.name} exited with code {m.exit_code()} before {what}:\n{m.tail()}")
                if ready(m):
                    pending.remove(m)
            if pending and time.monotonic() > deadline:
                raise FleetError(f"{pending[0].name} not {what} after {timeout:.0f} s:\n{pending[0].tail()}")
            if pending:
                self.stop_requested.wait(0.2)

    def announce(self) -> None:
        assert self.router is not None
        click.echo(
            f"{READY}{self.router.url} · policy {self.router_cfg.get('policy', 'cache_aware')} · "
            f"{len(self.workers)} workers {' '.join(w.url for w in self.workers)} · model {self.cfg['model']} · "
            f"router metrics {self.router.metrics_url} · logs {self.log_dir}"
        )
        sys.stdout.flush()

    def watch(self) -> int:
        """Until SIGTERM / SIGINT: report a worker that exits; stop everything if the router exits."""
        assert self.router is not None
        while not self.stop_requested.wait(0.5):
            if self.router.exit_code() is not None:
                click.echo(f"agentserve fleet up: the router exited with code {self.router.exit_code()}:\n"
                           f"{self.router.tail()}", err=True)
                return 1
            for w in self.workers:
                if w.exit_code() is not None and not w.reported_exit:
                    w.reported_exit = True
                    self.report_exit(w)
        log.info("received a stop signal; stopping the router, then the workers")
        return 0

    def report_exit(self, worker: Worker) -> None:
        removed = worker.clean_up()
        log.warning("%s (%s) exited with code %s; the router takes it out of rotation once its health checks "
                    "fail%s. Bring it back on the same port with: %s", worker.name, worker.url, worker.exit_code(),
                    f" (removed {len(removed)} leftovers)" if removed else "", shlex.join(worker.command))

    def stop(self) -> None:
        timeout = float(self.cfg["stop_timeout_s"])
        members: list[Member] = [self.router] if self.router is not None else []
        for group in (members, self.workers):
            for m in group:
                m.terminate()
            for m in group:
                m.wait(timeout)
        for w in self.workers:
            w.clean_up()
        if not self.keep_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)
