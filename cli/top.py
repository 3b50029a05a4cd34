"""``agentserve top``: a live dashboard of a running server, fed by its stats board.

Sources: ``--run NAME`` attaches the shared-memory stats board of that run (read-only, costs the
server nothing); ``--endpoint`` asks the server over its client socket (``GetStats``); with
neither, the one live run on this machine is used (both: exit 2).  ``--once --json`` prints one snapshot.  A server
started with ``--http`` gets a line for its gateway (requests/s, open streams, from its ``/metrics``).
Not on a terminal (a pipe, a file) it prints one plain frame per interval, and stops quietly once the pipe
is closed (``| head``).  Exit codes: 0 ok, Ctrl-C or a closed pipe, 2 no server / the server went away or
stopped publishing (``BOARD_STALL_S``: SIGSTOPped or hung).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Protocol

import click
from rich.console import Console
from rich.live import Live

from agentserve.cli.gateway_watch import GatewayStats, GatewayWatch
from agentserve.cli.top_view import render
from agentserve.client import AgentClient, AgentServeError
from agentserve.protocol.stats import (
    SNAPSHOT_VERSION,
    Snapshot,
    SnapshotError,
    decode_snapshot,
    to_json_obj,
)
from agentserve.shm.board import StatsBoard, list_runs
from agentserve.shm.errors import ShmError


class _Console(Console):
    def on_broken_pipe(self) -> None:  # rich's own exits 1; `top` ends as for every closed pipe (see `top`)
        raise BrokenPipeError


class TopError(RuntimeError):
    """No usable server to watch (a clear message for the user, exit code 2)."""


class Source(Protocol):
    def read(self) -> Snapshot: ...

    def close(self) -> None: ...


#: A board whose sequence has not moved for this long belongs to a stopped or hung server (a live one publishes
#: every 0.1 s; its loop may wait up to the executor's 10 s hang bound on a send).
BOARD_STALL_S = 15.0


class BoardSource:
    """Reads the stats board of ``run`` from shared memory."""

    def __init__(self, run: str) -> None:
        try:
            self._board = StatsBoard.attach(run, SNAPSHOT_VERSION, timeout=0.3)
        except (ShmError, FileNotFoundError) as e:
            raise TopError(f"no stats board for run {run!r}: {e}") from None
        except ValueError as e:  # a name no run can have (shm.segment.check_run)
            raise TopError(f"--run: {e}") from None
        self.run = run
        self._seen = (-1, time.monotonic())  # the board's sequence, and when it last moved
        self._first = True  # no read yet: see _check_fresh

    def read(self) -> Snapshot:
        if not self._board.writer_alive():
            raise TopError(f"the server of run {self.run!r} is gone")
        self._check_moving()
        data = self._board.read()
        if not data:
            raise TopError(f"run {self.run!r} has not published stats yet")
        try:
            snap = decode_snapshot(data)
        except SnapshotError as e:
            raise TopError(str(e)) from None
        self._check_fresh(snap)
        return snap

    def _check_fresh(self, snap: Snapshot) -> None:
        """A first read has no earlier sequence to compare with (``--once``): the snapshot's own time tells a board
        left by a server that stopped publishing ``BOARD_STALL_S`` ago or more."""
        if not self._first:
            return
        self._first = False
        age = time.time() - snap.t_wall
        if age > BOARD_STALL_S:
            raise self._stalled(age)

    def _check_moving(self) -> None:
        """A SIGSTOPped server keeps its pid and its board: without this its last snapshot showed as live for ever."""
        seq, now = self._board.sequence, time.monotonic()
        if seq != self._seen[0]:
            self._seen = (seq, now)
        elif now - self._seen[1] > BOARD_STALL_S:
            raise self._stalled(now - self._seen[1])

    def _stalled(self, seconds: float) -> TopError:
        return TopError(f"the server of run {self.run!r} has published no stats for {seconds:.0f} s: stopped or hung")

    def close(self) -> None:
        self._board.close()


class EndpointSource:
    """Asks the server at ``endpoint`` for its snapshot over the client protocol."""

    def __init__(self, endpoint: str, timeout: float = 3.0) -> None:
        try:
            self._client = AgentClient(endpoint, timeout=timeout, name="agentserve-top")
        except (AgentServeError, ValueError) as e:  # no server there, or an endpoint no client can connect to
            raise TopError(str(e)) from None

    def read(self) -> Snapshot:
        try:
            return decode_snapshot(self._client.stats())
        except (AgentServeError, SnapshotError) as e:
            raise TopError(str(e)) from None

    def close(self) -> None:
        self._client.close()


def open_source(run: str | None, endpoint: str | None) -> Source:
    if run and endpoint:  # each names the server to watch: neither may silently win
        raise TopError("give --run or --endpoint, not both")
    if endpoint:
        return EndpointSource(endpoint)
    if run:
        return BoardSource(run)
    runs = list_runs()
    if not runs:
        raise TopError("no running agentserve server found (start one with `agentserve up`)")
    if len(runs) > 1:
        raise TopError(f"several servers are running ({', '.join(sorted(runs))}): pick one with --run")
    return BoardSource(runs[0])


def _read(source: Source, watch: GatewayWatch) -> tuple[Snapshot, GatewayStats | None]:
    snap = source.read()
    return snap, watch.read(snap.server.http) if snap.server.http else None


def _json(snap: Snapshot, gateway: GatewayStats | None) -> dict:
    obj = to_json_obj(snap)
    if gateway is not None:
        obj["gateway"] = gateway.as_json()
    return obj


def _print_once(source: Source, as_json: bool, console: Console) -> None:
    snap, gateway = _read(source, GatewayWatch())
    if as_json:
        click.echo(json.dumps(_json(snap, gateway), indent=2))
    else:
        console.print(render(snap, console.width, gateway=gateway))


def _live(source: Source, interval: float, as_json: bool, console: Console) -> None:
    watch = GatewayWatch()
    if as_json or not console.is_terminal:  # for scripts and pipes: one JSON line / one plain frame per interval
        while True:
            snap, gateway = _read(source, watch)
            if as_json:
                click.echo(json.dumps(_json(snap, gateway)))
            else:  # Live would only draw at its stop on a console that is not a terminal
                console.print(render(snap, console.width, gateway=gateway))
                console.print()
            sys.stdout.flush()  # a closed pipe shows here, at once
            time.sleep(interval)
    with Live(console=console, auto_refresh=False, screen=False, transient=False) as live:
        while True:
            snap, gateway = _read(source, watch)
            live.update(render(snap, console.width, console.height, gateway), refresh=True)
            time.sleep(interval)


@click.command("top")
@click.option("--run", "run", default=None, help="Watch this run's stats board (default: the only live run).")
@click.option("--endpoint", default=None, help="Ask the server at this endpoint instead (ipc://… or tcp://…).")
@click.option("--interval", default=1.0, show_default=True, type=click.FloatRange(min=0.05), help="Seconds.")
@click.option("--once", is_flag=True, help="Print one snapshot and exit.")
@click.option("--json", "as_json", is_flag=True, help="JSON instead of the dashboard.")
def top(run: str | None, endpoint: str | None, interval: float, once: bool, as_json: bool) -> None:
    """Live view of a running server: partition rung, TPOT/TTFT vs SLO, queues, KV, and every agent."""
    console = _Console()
    try:
        source = open_source(run, endpoint)
    except TopError as e:
        click.echo(f"agentserve top: {e}", err=True)
        sys.exit(2)
    try:
        if once:
            _print_once(source, as_json, console)
        else:
            _live(source, interval, as_json, console)
    except TopError as e:
        click.echo(f"agentserve top: {e}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:  # `agentserve top | head`: the reader is done, and so are we
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at the exit's flush
    finally:
        source.close()
