"""PNG of an agent-count sweep, drawn from the sweep JSON alone (so it can be redrawn from a saved file).

Eight panels against the number of concurrent agents, each system a line (the same colour in every
figure): SLO attainment (TTFT and TPOT both, TTFT alone, TPOT alone; one shared 0–100 % axis), goodput,
TTFT p95 of cold and of resume turns (one shared log axis, the TTFT SLO dashed), TPOT p95 (the TPOT
SLO dashed) and token throughput. A system missing at a count (it failed there) leaves a gap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentserve.bench.plot_style import readable_log_axis, slo_line, style
from agentserve.bench.sweep_report import BY_KEY, number

# (row, column, headline key, y label, which SLO is drawn, the group whose panels share the y axis)
PANELS = [
    (0, 0, "slo_attainment", "requests meeting both SLOs (%)", None, "attainment"),
    (0, 1, "goodput", "requests meeting both SLOs per second", None, None),
    (1, 0, "ttft_slo_attainment", "requests meeting the TTFT SLO (%)", None, "attainment"),
    (1, 1, "tpot_slo_attainment", "requests meeting the TPOT SLO (%)", None, "attainment"),
    (2, 0, "ttft_cold_p95", "ms, log scale", "ttft_ms", "ttft"),
    (2, 1, "ttft_resume_p95", "ms, log scale", "ttft_ms", "ttft"),
    (3, 0, "tpot_p95", "ms, log scale", "tpot_ms", None),
    (3, 1, "throughput_tok_s", "output tokens per second", None, None),
]


def series(sweep: dict[str, Any], system: str, key: str) -> tuple[list[int], list[float | None]]:
    """Agent counts and the figure ``key`` of ``system`` at each (None where it has none)."""
    xs, ys = [], []
    for r in sweep["rows"]:
        xs.append(r["agents"])
        figs = r["systems"].get(system)
        ys.append(None if figs is None else figs.get(key))
    return xs, ys


def _scaled(values: list[float | None], unit: str) -> list[float]:
    return [float("nan") if v is None else v * (100.0 if unit == "%" else 1.0) for v in values]


def _panel(ax, sweep: dict[str, Any], key: str, ylabel: str, slo_ms: float | None) -> list[float]:
    head = BY_KEY[key]
    drawn: list[float] = []
    for i, name in enumerate(sweep["systems"]):
        xs, ys = series(sweep, name, key)
        ys = _scaled(ys, head.unit)
        # earlier systems drawn wider and larger: where lines coincide, every one still shows
        ax.plot(xs, ys, label=name, lw=max(2.6 - 0.3 * i, 1.0), ms=max(10 - 1.5 * i, 4), **style(name, i))
        drawn += [y for y in ys if y == y]
    if slo_ms is not None:
        slo_line(ax, slo_ms, "y", f"SLO {slo_ms:g} ms")
    ax.set_title(f"{head.label} ({head.unit})" if head.unit != "%" else head.label)
    ax.set_ylabel(ylabel)
    ax.set_xticks([r["agents"] for r in sweep["rows"]])
    ax.grid(True, alpha=0.3)
    return drawn


def figure(sweep: dict[str, Any]):
    """The sweep's figure (matplotlib); the caller saves or inspects it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta = sweep["meta"]
    slo = meta.get("slo") or {}
    fig, axes = plt.subplots(4, 2, figsize=(13, 16), sharex=True, layout="constrained")
    groups: dict[str, list[tuple[Any, list[float]]]] = {}
    for row, col, key, ylabel, slo_key, group in PANELS:
        ax = axes[row][col]
        slo_ms = slo.get(slo_key) if slo_key else None
        drawn = _panel(ax, sweep, key, ylabel, slo_ms)
        if group:
            groups.setdefault(group, []).append((ax, drawn + ([slo_ms] if slo_ms else [])))
        elif BY_KEY[key].unit == "ms":
            readable_log_axis(ax, "y", drawn + ([slo_ms] if slo_ms else []))
        else:
            ax.set_ylim(bottom=0, top=max(drawn, default=1.0) * 1.1 or 1.0)
    for ax, _ in groups.get("attainment", []):
        ax.set_ylim(0, 105)
    ttft = groups.get("ttft", [])
    for ax, _ in ttft:  # cold and resume TTFT on one scale: their heights compare
        readable_log_axis(ax, "y", [v for _, vs in ttft for v in vs])
    for ax in axes.flat:
        ax.tick_params(labelbottom=True)  # every panel keeps its agent counts
        ax.set_xlabel("concurrent agents")
    handles, labels = axes[3][0].get_legend_handles_labels()  # every system, and the SLO line
    labels = ["SLO (its value on the line)" if label.startswith("SLO") else label for label in labels]
    fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 8), frameon=False)
    fig.suptitle(f"{meta.get('workload', '?')}, model {meta.get('model', '?')}: {number(meta.get('duration_s'))} s "
                 f"measured × {meta.get('repeats', 1)} repeat(s) per point; SLO TTFT {number(slo.get('ttft_ms'))} ms, "
                 f"TPOT {number(slo.get('tpot_ms'))} ms")
    return fig



def plot(sweep: dict[str, Any], path: str | Path) -> None:
    """Write :func:`figure` to ``path`` (PNG)."""
    fig = figure(sweep)
    import matplotlib.pyplot as plt

    fig.savefig(str(path), dpi=100)
    plt.close(fig)
