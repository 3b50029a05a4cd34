"""`agentserve top`: rendering at 80 and 200 columns, and the --once --json command on each source."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from msgspec.structs import replace
from rich.console import Console
from snapshots import realistic

from agentserve.cli import top as cli_top
from agentserve.cli.top import BoardSource, TopError, top
from agentserve.cli.top_view import BLOCKS, render, sparkline
from agentserve.orchestrator.stats_publisher import BOARD_BYTES, fit_sessions
from agentserve.protocol.stats import (
    SNAPSHOT_VERSION,
    SessionState,
    Snapshot,
    decode_snapshot,
    encode_snapshot,
    to_json_obj,
)
from agentserve.shm.board import StatsBoard

sys.path.insert(0, str(Path(__file__).parent.parent / "client"))
from agent_fake_server import EchoServer  # noqa: E402


def screen(snap: Snapshot, width: int, height: int | None) -> list[str]:
    with open(os.devnull, "w") as sink:
        console = Console(width=width, height=height or 50, record=True, color_system=None, file=sink)
        console.print(render(snap, width, height))
    return console.export_text().splitlines()


def test_80x24_fits_and_shows_every_block():
    lines = screen(realistic(12), 80, 24)
    text = "\n".join(lines)
    assert len(lines) <= 24 and max(map(len, lines)) <= 80
    for needle in ("rung    3/9", "green_ctx", "B_prefill 256/1024", "p50 41.5", "p95 640",
                   "cold 2  resume 1  decode 4", "1830/4096", "prefix hits 73%", "decode 88%",
                   "react-agent-1", "prefilling", "in_tool", "+"):  # fmt: skip
        assert needle in text, needle
    assert "more" in text  # 12 sessions do not fit in 24 rows: the rest is counted


def test_thousands_of_sessions_still_reach_the_board_busiest_first():
    """The board holds 256 KiB: with ~2,800+ sessions the snapshot did not fit and was not published at all (`top`
    froze on the last one that fit).  Now the busiest sessions that fit are listed and the rest counted."""
    snap = realistic(6000)
    data = encode_snapshot(snap)
    assert len(data) > BOARD_BYTES
    fitted = decode_snapshot(fit_sessions(snap, data, BOARD_BYTES))
    assert len(fit_sessions(snap, data, BOARD_BYTES)) <= BOARD_BYTES and fitted.sessions_total == 6000
    listed = fitted.sessions
    assert len(listed) < 6000
    one_more = replace(fitted, sessions=[*listed, sorted(snap.sessions, key=lambda r: -r.id)[0]])
    assert len(encode_snapshot(one_more)) > BOARD_BYTES - 64  # as many as fit (a row is ~130 bytes)
    busiest = [SessionState.DECODING, SessionState.PREFILLING, SessionState.QUEUED, SessionState.IN_TOOL]
    ranks = [busiest.index(r.state) for r in listed]
    assert ranks == sorted(ranks) and listed[0].state == SessionState.DECODING  # at work first
    lines = screen(fitted, 80, 24)
    shown = sum("react-agent" in line for line in lines)
    assert shown > 0 and f"+{6000 - shown} more" in "\n".join(lines)  # the rows the board left out are counted too
    small = encode_snapshot(realistic(6))
    assert fit_sessions(realistic(6), small, BOARD_BYTES) is small


def test_200_columns_puts_blocks_side_by_side_and_lists_all_sessions():
    lines = screen(realistic(6), 200, 50)
    assert max(map(len, lines)) <= 200
    assert any("rung" in ln and "queues" in ln for ln in lines)  # side by side
    assert all(f"react-agent-{i}" in "\n".join(lines) for i in range(1, 7))
    assert "more" not in "\n".join(lines)
    assert len(lines) < len(screen(realistic(6), 80, None))


def test_long_backend_reason_and_model_path_stay_on_one_line_at_80x24():
    snap = realistic(30)
    snap.partition.reason = "green-ctx unavailable: " + "no driver; " * 30
    snap.server.model = "/root/.cache/agentserve/models/" + "very-long-model-name-" * 5
    lines = screen(snap, 80, 24)
    assert len(lines) <= 24 and max(map(len, lines)) <= 80
    assert any(ln.startswith("backend cpu") or ln.startswith("backend green_ctx") for ln in lines)
    assert "/root/.cache" not in lines[0]  # the header names the model, not its folder


def test_empty_snapshot_renders():
    text = "\n".join(screen(Snapshot(), 80, 24))
    assert "no sessions" in text


def test_sparkline_scales_and_marks_values_over_the_slo():
    line = sparkline([0, 20, 40, 80], slo=50, width=10)
    assert len(line.plain) == 4
    assert line.plain[-1] == BLOCKS[-1] and line.plain[0] == BLOCKS[0]
    styles = [str(span.style) for span in line.spans]
    assert styles == ["green", "green", "green", "red"]
    assert sparkline([1.0] * 100, 0, 12).plain == BLOCKS[-1] * 12  # last `width` values, no SLO
    assert sparkline([], 5, 4).plain == "····"


def test_snapshot_json_has_every_field_and_round_trips():
    snap = realistic()
    obj = to_json_obj(snap)
    assert obj["version"] == SNAPSHOT_VERSION and obj["sessions"][0]["state"] == "queued"
    assert decode_snapshot(encode_snapshot(snap)) == snap


# ---- the command ---------------------------------------------------------------------------------


@pytest.fixture
def board():
    run = f"toptest{os.getpid()}"
    b = StatsBoard.create(run, 64 * 1024, SNAPSHOT_VERSION)
    b.publish(encode_snapshot(fresh(realistic())))
    yield run
    b.close()


def test_once_json_from_the_stats_board(board):
    res = CliRunner().invoke(top, ["--run", board, "--once", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out == to_json_obj(replace(realistic(), t_wall=out["t_wall"])) and abs(out["t_wall"] - time.time()) < 60


def test_once_dashboard_from_the_stats_board(board):
    res = CliRunner().invoke(top, ["--run", board, "--once"])
    assert res.exit_code == 0, res.output
    assert "react-agent-6" in res.output and "green_ctx" in res.output


def test_a_board_that_stops_moving_is_a_clear_error_not_a_frozen_dashboard(monkeypatch):
    """A SIGSTOPped (or hung) server keeps its board and a live pid: top showed its last snapshot for ever."""
    monkeypatch.setattr(cli_top, "BOARD_STALL_S", 0.2, raising=False)
    run = f"topstall{os.getpid()}"
    with StatsBoard.create(run, 64 * 1024, SNAPSHOT_VERSION) as b:
        b.publish(encode_snapshot(fresh(realistic())))
        source = BoardSource(run)
        try:
            source.read()
            time.sleep(0.5)
            b.publish(encode_snapshot(fresh(realistic())))  # it moved since: still live, however long ago the last read
            source.read()
            time.sleep(0.5)
            with pytest.raises(TopError, match=f"run '{run}' has published no stats for .* stopped or hung"):
                source.read()
        finally:
            source.close()


def test_once_on_a_board_left_unchanged_for_long_is_a_clear_error_not_its_last_snapshot(monkeypatch):
    """``--once`` reads once, so the board's sequence cannot show a stopped server: the snapshot's own time does."""
    monkeypatch.setattr(cli_top, "BOARD_STALL_S", 5.0, raising=False)
    run = f"topstale{os.getpid()}"
    with StatsBoard.create(run, 64 * 1024, SNAPSHOT_VERSION) as b:
        b.publish(encode_snapshot(replace(realistic(), t_wall=time.time() - 6)))
        res = CliRunner().invoke(top, ["--run", run, "--once", "--json"])
        assert res.exit_code == 2 and "has published no stats for 6 s: stopped or hung" in res.output, res.output
        b.publish(encode_snapshot(replace(realistic(), t_wall=time.time() - 4)))
        assert CliRunner().invoke(top, ["--run", run, "--once", "--json"]).exit_code == 0


def fresh(snap: Snapshot) -> Snapshot:
    """``snap`` as just published (a board's first read refuses a snapshot older than ``BOARD_STALL_S``)."""
    return replace(snap, t_wall=time.time())


def test_once_json_from_an_endpoint(tmp_path):
    with EchoServer(f"ipc://{tmp_path}/s.sock") as srv:
        res = CliRunner().invoke(top, ["--endpoint", srv.endpoint, "--once", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["server"]["model"] == "echo"


def test_no_server_is_exit_2_with_a_clear_message(tmp_path):
    res = CliRunner().invoke(top, ["--run", "nosuchrun-xyz", "--once"])
    assert res.exit_code == 2 and "no stats board" in res.output
    res = CliRunner().invoke(top, ["--endpoint", f"ipc://{tmp_path}/none.sock", "--once", "--json"])
    assert res.exit_code == 2 and "no AgentServe server" in res.output


@pytest.mark.parametrize("args, says", [
    (["--run", "bad/name"], "run name must match"),  # a traceback from shm.segment.check_run
    (["--endpoint", "bogus"], "ipc:// or tcp://"),  # zmq tracebacks
    (["--endpoint", "http://127.0.0.1:8000"], "ipc:// or tcp://"),
    (["--run", "r", "--endpoint", "ipc:///tmp/agentserve-r.sock"], "not both"),  # the endpoint won without a word
])
def test_a_run_or_endpoint_that_cannot_be_is_one_line_and_exit_2(args, says):
    res = subprocess.run(["agentserve", "top", *args, "--once"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and says in res.stderr and len(res.stderr.splitlines()) == 1, res.stderr


def _top_into_a_pipe(run: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")}
    return subprocess.Popen(["agentserve", "top", "--run", run, "--interval", "0.1"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)


def _read_until(proc: subprocess.Popen, frames: int, timeout: float) -> bytes:
    """What top wrote until ``frames`` dashboards came or ``timeout`` passed (without blocking on a silent top)."""
    out, deadline = b"", time.monotonic() + timeout
    while out.count(b"AgentServe") < frames and time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.1)[0]:
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            out += chunk
    return out


def test_live_top_into_a_pipe_prints_a_plain_frame_per_interval(board):
    """Not a terminal: rich's Live drew nothing until it stopped."""
    proc = _top_into_a_pipe(board)
    try:
        out = _read_until(proc, 3, 30)
    finally:
        proc.kill()
        proc.communicate()
    assert out.count(b"AgentServe") >= 3, out
    assert b"react-agent-6" in out and b"\x1b[" not in out  # every row, no cursor control or colour


def test_live_top_stops_quietly_when_the_pipe_closes(board):
    """`agentserve top | head` never noticed head was gone and ran on."""
    proc = _top_into_a_pipe(board)
    try:
        assert b"AgentServe" in _read_until(proc, 1, 30)
        proc.stdout.close()
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.stderr.read() == b""


def test_the_board_carries_the_schedulers_kv_counts() -> None:
    """Preemptions, evictions and broken pins were counted by the scheduler but reached no board, `top` or metric:
    memory pressure was invisible without a step trace."""
    from agentserve.orchestrator.stats_publisher import StatsPublisher

    stats = {"kv": {"used": 5, "blocks": 8, "held_by_sessions": 2, "evictions": 4}, "preemptions": 3, "pins_broken": 1}
    kv = StatsPublisher._kv(stats, None)
    assert (kv.preemptions, kv.evictions, kv.pins_broken, kv.pinned_blocks) == (3, 4, 1, 2)
    lines = screen(replace(realistic(), kv=kv), 200, None)
    assert any("preempted 3  evicted 4" in line for line in lines), lines
