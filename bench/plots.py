"""PNG plots of one agent count (matplotlib, Agg backend, imported only when plotting).

Top row: CDFs of cold-turn TTFT, resume-turn TTFT and TPOT, one line per system, the SLO dashed.
Below, one panel per system: the inter-token latency of every chunk over time (the stutter a user
sees), each request's TPOT at its finish time, a vertical line at every cold-prefill arrival (the
head-of-line blockers) and the TPOT SLO. These panels share both axes, so their heights compare.
Every latency axis is logarithmic with labelled ticks inside its range.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from agentserve.bench.metrics import SLO, RunRecord
from agentserve.bench.plot_style import readable_log_axis, slo_line, style

MS = 1000.0


def _cdf(ax, values: list[float], label: str, index: int) -> None:
    if not values:
        return
    x = np.sort(np.asarray(values) * MS)
    ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=label, color=style(label, index)["color"], lw=1.6)


def _cdf_panel(ax, runs: dict[str, RunRecord], what: str, pick, slo_ms: float | None) -> None:
    values: list[float] = []
    for i, (name, run) in enumerate(runs.items()):
        xs = [v for v in (pick(r) for r in run.requests if r.ok) if v is not None]
        _cdf(ax, xs, name, i)
        values += [v * MS for v in xs]
    slo_line(ax, slo_ms, "x", f"SLO {slo_ms:g} ms" if slo_ms is not None else "")
    readable_log_axis(ax, "x", [*values, *([slo_ms] if slo_ms else [])])
    ax.set_ylim(0, 1.02)
    ax.set_xlabel(f"{what} (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"{what} CDF")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", loc="lower right")


def _timeline_values(run: RunRecord) -> list[float]:
    done = [r for r in run.requests if r.ok]
    return [x * MS for r in done for x in r.itls] + [r.tpot * MS for r in done if r.tpot is not None]


def _timeline(ax, name: str, run: RunRecord, index: int) -> None:
    done = [r for r in run.requests if r.ok]
    colour = style(name, index)["color"]
    itl_t = [t - run.start for r in done for t, _ in r.chunks[1:]]
    itl_v = [x * MS for r in done for x in r.itls]
    ax.plot(itl_t, itl_v, ".", ms=1.5, alpha=0.35, color="grey", label="inter-token latency")
    tp = [(r.chunks[-1][0] - run.start, r.tpot * MS) for r in done if r.tpot is not None]
    if tp:
        ax.plot(*zip(*tp, strict=True), "o", ms=3, color=colour, label="request TPOT")
    for i, r in enumerate(x for x in run.requests if x.kind == "cold"):
        ax.axvline(r.sent - run.start, color="red", lw=0.6, alpha=0.5, label="cold prefill sent" if i == 0 else None)
    ax.set_title(f"{name}: inter-token latency and TPOT over time", loc="left")
    ax.set_ylabel("latency (ms, log scale)")
    ax.grid(True, axis="y", alpha=0.3)


def figure(runs: dict[str, RunRecord], slo: SLO | None = None, title: str | None = None):
    """The matplotlib figure for ``runs`` (system name → recorded run); the caller saves or inspects it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ttft_ms = slo.ttft_s * MS if slo else None
    tpot_ms = slo.tpot_s * MS if slo else None
    fig = plt.figure(figsize=(15, 4.2 + 3.2 * len(runs)), layout="constrained")
    grid = fig.add_gridspec(1 + len(runs), 3, height_ratios=[1.3] + [1.0] * len(runs))
    panels = (("TTFT of cold turns", lambda r: r.ttft if r.kind == "cold" else None, ttft_ms),
              ("TTFT of resume turns", lambda r: r.ttft if r.kind == "resume" else None, ttft_ms),
              ("TPOT", lambda r: r.tpot, tpot_ms))
    for col, (what, pick, slo_ms) in enumerate(panels):
        _cdf_panel(fig.add_subplot(grid[0, col]), runs, what, pick, slo_ms)
    shared = [v for run in runs.values() for v in _timeline_values(run)] + ([tpot_ms] if tpot_ms else [])
    longest = max((run.elapsed for run in runs.values()), default=1.0)
    first = None
    for row, (name, run) in enumerate(runs.items(), start=1):
        ax = fig.add_subplot(grid[row, :], sharex=first, sharey=first)
        first = first or ax
        _timeline(ax, name, run, row - 1)
        slo_line(ax, tpot_ms, "y", f"TPOT SLO {tpot_ms:g} ms" if tpot_ms else "")
        ax.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize="small", ncols=4, frameon=False)
    if first is not None:
        readable_log_axis(first, "y", shared)
        first.set_xlim(0, max(longest, 1e-3))
        fig.axes[-1].set_xlabel("time since the measured window began (s; repeats laid end to end)")
    if title:
        fig.suptitle(title)
    return fig


def plot(runs: dict[str, RunRecord], path: str | Path, slo: SLO | None = None, title: str | None = None) -> None:
    """Write :func:`figure` for ``runs`` to ``path`` (PNG)."""
    fig = figure(runs, slo, title)
    import matplotlib.pyplot as plt

    fig.savefig(str(path), dpi=100)
    plt.close(fig)
