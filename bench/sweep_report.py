"""The report of an agent-count sweep: one row per agent count with every system's headline figures.

Layout of the JSON (``build``)::

    {"meta": {... "agents": [1, 2, 4], "failed": {"2": ["llama-server"]}, ...},
     "reference": "agentserve", "systems": ["agentserve", "fcfs"],
     "rows": [{"agents": 1, "systems": {"fcfs": {"slo_attainment": 0.93, ..., "ratios": {...}}}}],
     "points": [<a single-count report (bench.report.build) per agent count>]}

``rows`` carry the figures plotted against the agent count (:data:`HEADLINE`), ``points`` every figure
of every run. A single-count report reads as a one-row sweep through :func:`as_sweep`. Ratios are
``system / reference`` as in :mod:`agentserve.bench.report`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.table import Table

from agentserve.bench import report as reporting


@dataclass(frozen=True)
class Headline:
    """A figure of the sweep rows: its key, label, path in the per-system figures, unit, better side."""

    key: str
    label: str
    path: tuple[str, ...]
    unit: str
    better: str  # "higher" | "lower"


HEADLINE: list[Headline] = [
    Headline("slo_attainment", "SLO attainment (TTFT and TPOT)", ("slo_attainment",), "%", "higher"),
    Headline("ttft_slo_attainment", "TTFT SLO attainment", ("ttft_slo_attainment",), "%", "higher"),
    Headline("tpot_slo_attainment", "TPOT SLO attainment", ("tpot_slo_attainment",), "%", "higher"),
    Headline("goodput", "goodput", ("goodput",), "req/s", "higher"),
    Headline("ttft_p95", "TTFT p95", ("ttft", "p95"), "ms", "lower"),
    Headline("ttft_cold_p50", "TTFT cold p50", ("ttft_cold", "p50"), "ms", "lower"),
    Headline("ttft_cold_p95", "TTFT cold p95", ("ttft_cold", "p95"), "ms", "lower"),
    Headline("ttft_resume_p50", "TTFT resume p50", ("ttft_resume", "p50"), "ms", "lower"),
    Headline("ttft_resume_p95", "TTFT resume p95", ("ttft_resume", "p95"), "ms", "lower"),
    Headline("tpot_p50", "TPOT p50", ("tpot", "p50"), "ms", "lower"),
    Headline("tpot_p95", "TPOT p95", ("tpot", "p95"), "ms", "lower"),
    Headline("ttft_std", "TTFT std", ("ttft", "std"), "ms", "lower"),
    Headline("tpot_std", "TPOT std", ("tpot", "std"), "ms", "lower"),
    Headline("throughput_tok_s", "throughput", ("throughput_tok_s",), "tok/s", "higher"),
]
BY_KEY = {h.key: h for h in HEADLINE}
# the columns of the per-count tables (terminal and markdown)
TABLE_KEYS = ("slo_attainment", "ttft_slo_attainment", "tpot_slo_attainment", "goodput", "ttft_cold_p50",
              "ttft_cold_p95", "ttft_resume_p50", "ttft_resume_p95", "tpot_p95", "throughput_tok_s")


# meta keys that belong to one agent count, kept in its point, not in the sweep's meta
PER_POINT = ("agents", "failed", "per_repeat_ratios")


def _row_figures(figures: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {h.key: reporting.get(figures, h.path) for h in HEADLINE}
    out["requests"], out["errors"] = figures.get("requests", 0), figures.get("errors", 0)
    out["short_replies"] = figures.get("short_replies", 0)
    ratios = {}
    for h in HEADLINE:
        a, b = out[h.key], reporting.get(reference, h.path)
        ratios[h.key] = a / b if a is not None and b else None
    out["ratios"] = ratios
    return out


def row(point: dict[str, Any]) -> dict[str, Any]:
    """The headline row of one single-count report (``bench.report.build``)."""
    systems = point["policies"]
    ref = systems[point["reference"]]
    return {"agents": point["meta"]["agents"], "reference": point["reference"],  # its own, if the sweep's failed here
            "systems": {name: _row_figures(figs, ref) for name, figs in systems.items()}}


def build(points: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """The sweep JSON from its single-count reports (agent counts in the order they ran)."""
    if not points:
        raise ValueError("a sweep report needs at least one agent count")
    systems: list[str] = []
    for p in points:
        systems += [n for n in p["policies"] if n not in systems]
    reference = reporting.REFERENCE if reporting.REFERENCE in systems else systems[0]
    shared = {k: v for k, v in points[0]["meta"].items() if k not in PER_POINT}
    return {"meta": {**shared, **meta, "agents": [p["meta"]["agents"] for p in points]},
            "reference": reference, "systems": systems, "rows": [row(p) for p in points], "points": points}


def as_sweep(report: dict[str, Any]) -> dict[str, Any]:
    """A report of either kind as a sweep (a single-count report becomes a one-row sweep)."""
    if "rows" in report:
        return report
    meta = {**report["meta"], "agents": [report["meta"]["agents"]]}
    failed = report["meta"].get("failed") or []
    meta["failed"] = {str(report["meta"]["agents"]): failed} if failed else {}
    return {"meta": meta, "reference": report["reference"], "systems": list(report["policies"]),
            "rows": [row(report)], "points": [report]}


def fmt(value: float | None, unit: str) -> str:
    """A figure as text with its unit ("–" when undefined)."""
    if value is None:
        return "–"
    if unit == "%":
        return f"{value * 100:.1f} %"
    text = f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return f"{text} {unit}"


def number(value: Any) -> str:
    """A setting as written (20, 0.5, 2000), "?" when it was not recorded."""
    return f"{value:g}" if isinstance(value, int | float) else "?"


def fmt_ratio(ratio: float | None) -> str:
    return "–" if ratio is None else f"{ratio:.2f}×"


def headline_table(sweep_row: dict[str, Any], reference: str, slo: dict[str, Any] | None = None) -> Table:
    """A rich table of one agent count: a row per headline figure, a column per system, ratios to the row's
    reference (``reference``, the sweep's, unless that system failed at this count)."""
    n = sweep_row["agents"]
    reference = sweep_row.get("reference", reference)
    slo_text = f" · SLO TTFT {number(slo.get('ttft_ms'))} ms, TPOT {number(slo.get('tpot_ms'))} ms" if slo else ""
    t = Table(title=f"{n} agent{'s' if n != 1 else ''}{slo_text}", caption=f"(ratio) = system / {reference}")
    t.add_column("figure")
    for name in sweep_row["systems"]:
        t.add_column(name, justify="right")
    for key in TABLE_KEYS:
        cells = []
        for name, figs in sweep_row["systems"].items():
            text = fmt(figs[key], BY_KEY[key].unit)
            if name != reference and figs["ratios"][key] is not None:
                text += f" [dim]({fmt_ratio(figs['ratios'][key])})[/dim]"
            cells.append(text)
        t.add_row(BY_KEY[key].label, *cells)
    t.add_row("requests / errors", *[reporting.requests_cell(f) for f in sweep_row["systems"].values()])
    return t


def markdown_table(sweep_row: dict[str, Any], reference: str) -> str:
    """The same table in Markdown (for ``paper.md``), with the row's own reference named where it differs."""
    own = sweep_row.get("reference", reference)
    head = ["system", *(f"{BY_KEY[k].label} ({BY_KEY[k].unit})" for k in TABLE_KEYS), "requests / errors"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, figs in sweep_row["systems"].items():
        cells = [name]
        for key in TABLE_KEYS:
            text = fmt(figs[key], BY_KEY[key].unit).removesuffix(" " + BY_KEY[key].unit)
            if name != own and figs["ratios"][key] is not None:
                text += f" ({fmt_ratio(figs['ratios'][key])})"
            cells.append(text)
        cells.append(reporting.requests_cell(figs))
        lines.append("| " + " | ".join(cells) + " |")
    note = "" if own == reference else f"\n\n{reference} failed at this count: ratios here are system / {own}."
    return "\n".join(lines) + note
