"""Rendering of one stats snapshot for `agentserve top` (pure: snapshot in, rich renderable out)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import PurePath

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from agentserve.cli.gateway_watch import GatewayStats
from agentserve.protocol.stats import Latency, SessionState, Snapshot

BLOCKS = "▁▂▃▄▅▆▇█"
WIDE = 150  # from this many columns on, the stat blocks sit side by side

STATE_STYLE = {
    SessionState.QUEUED: "yellow",
    SessionState.PREFILLING: "magenta",
    SessionState.DECODING: "green",
    SessionState.IN_TOOL: "cyan",
    SessionState.IDLE: "dim",
}


def sparkline(values: Sequence[float], slo: float, width: int) -> Text:
    """Unicode-block sparkline of the last ``width`` values; red above ``slo`` (if set), green below."""
    values = list(values)[-width:] if width > 0 else []
    if not values:
        return Text("·" * max(width, 0), style="dim")
    top = max(max(values), slo * 1.25 if slo > 0 else 0.0) or 1.0
    out = Text()
    for v in values:
        level = min(len(BLOCKS) - 1, max(0, round(v / top * (len(BLOCKS) - 1))))
        out.append(BLOCKS[level], style="red" if slo > 0 and v > slo else "green")
    return out


def _ms(v: float) -> str:
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def _pct(v: float) -> str:
    return f"{100 * v:.0f}%"


def _uptime(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def header(snap: Snapshot) -> Text:
    srv = snap.server
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append("AgentServe", style="bold")
    t.append(f"  {PurePath(srv.model).name or '?'}", style="cyan")
    t.append(f"  {snap.control.policy or '?'}", style="magenta")
    t.append(f"  pid {srv.pid}  up {_uptime(srv.uptime_s)}")
    t.append(f"  {srv.endpoint}", style="dim")
    return t


def gateway_line(gw: GatewayStats) -> Text:
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append("HTTP  ", style="bold")
    t.append(gw.url, style="dim")
    if not gw.reachable:
        t.append("  unreachable (restarting?)", style="red")
        return t
    rate = "…" if gw.requests_per_s is None else f"{gw.requests_per_s:.1f}"
    t.append(f"  {rate} req/s  {gw.open_streams:.0f} open streams  {gw.requests_total:.0f} requests")
    if gw.errors_total:
        t.append(f"  {gw.errors_total:.0f} errors", style="yellow")
    return t


def _grid() -> Table:
    g = Table.grid(padding=(0, 1))
    g.add_column(style="bold", no_wrap=True, min_width=7)
    g.add_column(no_wrap=True, overflow="ellipsis")  # one line per row, whatever the width
    return g


def partition_block(snap: Snapshot) -> Table:
    p, c = snap.partition, snap.control
    g = _grid()
    rung = f"{p.rung}/{max(p.num_rungs - 1, 0)}" if p.partitioned else "shared"
    g.add_row(
        "rung",
        f"{rung}  decode {p.decode_units} {p.unit} · prefill {p.prefill_units} {p.unit} of {p.total_units}",
    )
    reason = " ".join(p.reason.split())  # one line: after a failed green-ctx warm-up it holds a CUDA error's lines
    g.add_row("backend", Text(f"{p.backend or '?'}", style="cyan") + Text(f"  {reason}", style="dim"))
    parts = [f"B_prefill {c.b_prefill}" + (f"/{c.b_prefill_max}" if c.b_prefill_max else "")]
    if c.r_min:
        parts.append(f"R_min {c.r_min}")
    if c.tpot_high_ms:
        parts.append(f"band {_ms(c.tpot_low_ms)}–{_ms(c.tpot_high_ms)} ms")
    parts.append(f"moves {c.adjustments}")
    g.add_row("control", "  ".join(parts))
    return g


def _latency_row(g: Table, name: str, lat: Latency, spark_width: int) -> None:
    slo = f" / SLO {_ms(lat.slo_ms)}" if lat.slo_ms else ""
    over = lat.slo_ms > 0 and lat.p95_ms > lat.slo_ms
    nums = Text(f"p50 {_ms(lat.p50_ms)}  p95 {_ms(lat.p95_ms)}{slo} ms ", style="red" if over else "")
    g.add_row(name, nums + sparkline(lat.history_ms, lat.slo_ms, spark_width))


def latency_block(snap: Snapshot, spark_width: int) -> Table:
    g = _grid()
    _latency_row(g, "TPOT", snap.tpot, spark_width)
    _latency_row(g, "TTFT", snap.ttft, spark_width)
    return g


def load_block(snap: Snapshot) -> Table:
    q, kv = snap.queues, snap.kv
    g = _grid()
    g.add_row("queues", f"cold {q.cold}  resume {q.resume}  decode {q.decode}")
    used = kv.used_blocks / kv.total_blocks if kv.total_blocks else 0.0
    g.add_row(
        "KV",
        f"{kv.used_blocks}/{kv.total_blocks} blocks ({_pct(used)})  pinned {kv.pinned_blocks}  "
        f"prefix hits {_pct(kv.prefix_hit_rate)}  preempted {kv.preemptions}  evicted {kv.evictions}",
    )
    lanes = "  ".join(
        f"{ln.name} {_pct(ln.utilisation)} {ln.tokens_per_s:.0f} tok/s gap {ln.gap_p50_ms:.1f} ms" for ln in snap.lanes
    )
    g.add_row("lanes", lanes or "-")
    g.add_row("totals", f"{snap.turns_done} turns  {snap.tokens_out} tokens  {snap.tokens_per_s:.0f} tok/s")
    return g


def sessions_table(snap: Snapshot, max_rows: int | None, wide: bool) -> Table:
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, expand=not wide, padding=(0, 1))
    t.add_column("id", justify="right", no_wrap=True)
    t.add_column("agent", no_wrap=True, overflow="ellipsis", max_width=24 if wide else 12)
    t.add_column("state", no_wrap=True)
    t.add_column("turn", justify="right")
    t.add_column("ctx", justify="right")
    t.add_column("tok", justify="right")
    t.add_column("TTFT ms", justify="right", no_wrap=True)
    t.add_column("TPOT ms", justify="right", no_wrap=True)
    rows = snap.sessions
    shown = rows if max_rows is None or len(rows) <= max_rows else rows[: max(max_rows - 1, 0)]
    slo = snap.tpot.slo_ms
    for r in shown:
        tpot_style = "red" if slo > 0 and r.last_tpot_ms > slo else ""
        t.add_row(
            str(r.id),
            r.name or "-",
            Text(r.state.value, style=STATE_STYLE.get(r.state, "")),
            str(r.turn),
            str(r.context_tokens),
            str(r.turn_tokens),
            _ms(r.last_ttft_ms) if r.last_ttft_ms else "-",
            Text(_ms(r.last_tpot_ms), style=tpot_style) if r.last_tpot_ms else "-",
        )
    hidden = max(snap.sessions_total, len(rows)) - len(shown)  # the board lists the busiest that fit in it
    if hidden > 0:
        t.add_row("", Text(f"+{hidden} more", style="dim"), "", "", "", "", "", "")
    elif not rows:
        t.add_row("", Text("no sessions", style="dim"), "", "", "", "", "", "")
    return t


def render(snap: Snapshot, width: int, height: int | None = None, gateway: GatewayStats | None = None
           ) -> RenderableType:
    """The whole dashboard for a terminal ``width`` columns wide (and ``height`` rows, if known); with
    ``gateway``, a line for the HTTP gateway under the header."""
    wide = width >= WIDE
    if wide:
        spark = max(10, min(80, width // 2 - 45))
        stats = Table.grid(padding=(0, 3), expand=True)
        stats.add_column(ratio=1)
        stats.add_column(ratio=1)
        stats.add_row(Group(partition_block(snap), latency_block(snap, spark)), load_block(snap))
        stat_lines = 5
    else:
        spark = max(8, width - 46)
        stats = Group(partition_block(snap), latency_block(snap, spark), load_block(snap))
        stat_lines = 9
    lines = [header(snap)] + ([gateway_line(gateway)] if gateway is not None else [])
    budget = None if height is None else max(1, height - stat_lines - len(lines) - 4)  # table chrome
    return Group(*lines, stats, sessions_table(snap, budget, wide))
