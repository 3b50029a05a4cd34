"""PNG plots of a benchmark (matplotlib, Agg backend, imported only when plotting).

Top row: TTFT CDF and TPOT CDF, one line per system. Below, one panel per system: the inter-token
latency of every chunk over time (the stutter a user sees), each request's TPOT at its finish time,
and a vertical line at every cold-prefill arrival (the head-of-line blockers).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from agentserve.bench.metrics import RunRecord


def _cdf(ax, values: list[float], label: str) -> None:
    if not values:
        return
    x = np.sort(np.asarray(values) * 1000.0)
    ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=label)


def _timeline(ax, name: str, run: RunRecord) -> None:
    done = [r for r in run.requests if r.ok]
    itl_t = [t - run.start for r in done for t, _ in r.chunks[1:]]
    itl_v = [x * 1000.0 for r in done for x in r.itls]
    ax.plot(itl_t, itl_v, ".", ms=1.5, alpha=0.4, label="inter-token latency")
    tp = [(r.chunks[-1][0] - run.start, r.tpot * 1000.0) for r in done if r.tpot is not None]
    if tp:
        ax.plot(*zip(*tp, strict=True), "o", ms=3, label="request TPOT")
    for i, r in enumerate(x for x in run.requests if x.kind == "cold"):
        ax.axvline(r.sent - run.start, color="red", lw=0.7, alpha=0.6,
                   label="cold prefill" if i == 0 else None)
    ax.set_title(f"{name}: TPOT over time")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax.legend(loc="upper right", fontsize="small")


def plot(runs: dict[str, RunRecord], path: str | Path) -> None:
    """Write the figure for ``runs`` (system name → recorded run) to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, axes = plt.subplots(1 + len(runs), 2, figsize=(12, 3.5 * (1 + len(runs))), squeeze=False)
    ttft_ax, tpot_ax = axes[0]
    for name, run in runs.items():
        done = [r for r in run.requests if r.ok]
        _cdf(ttft_ax, [r.ttft for r in done], name)
        _cdf(tpot_ax, [r.tpot for r in done if r.tpot is not None], name)
    for ax, what in ((ttft_ax, "TTFT"), (tpot_ax, "TPOT")):
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(f"{what} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{what} CDF")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    for row, (name, run) in enumerate(runs.items(), start=1):
        gs = axes[row][0].get_gridspec()
        for ax in axes[row]:
            ax.remove()
        _timeline(fig.add_subplot(gs[row, :]), name, run)
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
    plt.close(fig)
