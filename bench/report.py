"""Benchmark report: figures per system, their ratios to the reference system, a table, a JSON file.

Every ratio is ``value(system) / value(reference)`` for the same figure, the reference being
``agentserve`` (or the first system when it was not run): for latencies a ratio above 1 means the
system is that many times slower than AgentServe; for throughput, attainment and goodput a ratio
below 1 means it delivers less.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from agentserve.bench import machine

REFERENCE = "agentserve"

# (label, path into the figures dict, unit); the figures that get a row and a ratio
FIGURES: list[tuple[str, tuple[str, ...], str]] = [
    ("TTFT p50", ("ttft", "p50"), "ms"),
    ("TTFT p95", ("ttft", "p95"), "ms"),
    ("TTFT p99", ("ttft", "p99"), "ms"),
    ("TTFT cold p50", ("ttft_cold", "p50"), "ms"),
    ("TTFT cold p95", ("ttft_cold", "p95"), "ms"),
    ("TTFT resume p50", ("ttft_resume", "p50"), "ms"),
    ("TTFT resume p95", ("ttft_resume", "p95"), "ms"),
    ("TPOT mean", ("tpot", "mean"), "ms"),
    ("TPOT p50", ("tpot", "p50"), "ms"),
    ("TPOT p95", ("tpot", "p95"), "ms"),
    ("TPOT p99", ("tpot", "p99"), "ms"),
    ("TPOT std", ("tpot", "std"), "ms"),
    ("ITL p99", ("itl", "p99"), "ms"),
    ("E2E p95", ("e2e", "p95"), "ms"),
    ("task time mean", ("task_time_s", "mean"), "s"),
    ("throughput", ("throughput_tok_s",), "tok/s"),
    ("SLO attainment", ("slo_attainment",), "%"),
    ("goodput", ("goodput",), "req/s"),
]


def get(figures: dict[str, Any], path: tuple[str, ...]) -> float | None:
    node: Any = figures
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return None if node is None else float(node)


def _key(path: tuple[str, ...]) -> str:
    return "_".join(path)


def ratios(figures: dict[str, Any], reference: dict[str, Any]) -> dict[str, float | None]:
    """``figure / reference figure`` for every row of :data:`FIGURES` (None when undefined)."""
    out: dict[str, float | None] = {}
    for _, path, _ in FIGURES:
        a, b = get(figures, path), get(reference, path)
        out[_key(path)] = a / b if a is not None and b else None
    return out


def reference_of(systems: dict[str, Any]) -> str:
    """The system every ratio is taken against: ``agentserve`` if it ran, else the first."""
    return REFERENCE if REFERENCE in systems else next(iter(systems))


def build(systems: dict[str, dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """The JSON report: ``{"meta": ..., "reference": name, "policies": {name: figures + ratios}}``."""
    if not systems:
        raise ValueError("no system was benchmarked")
    ref = reference_of(systems)
    policies = {name: {**figs, "ratios": ratios(figs, systems[ref])} for name, figs in systems.items()}
    # the machine and its load: a busy machine skews every figure
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **machine.describe(), **meta}
    return {"meta": meta, "reference": ref, "policies": policies}


def write_json(report: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def _cell(value: float | None, unit: str, ratio: float | None, is_ref: bool) -> str:
    if value is None:
        return "–"
    text = f"{value * 100:.1f}%" if unit == "%" else f"{value:,.3g}" if value < 100 else f"{value:,.0f}"
    if unit not in ("%",):
        text += f" {unit}"
    if ratio is not None and not is_ref:
        text += f" [dim]({ratio:.2f}×)[/dim]"
    return text


def table(report: dict[str, Any]) -> Table:
    """A rich table: one row per figure, one column per system, ratios to the reference in brackets."""
    ref = report["reference"]
    meta = report["meta"]
    t = Table(title=f"{meta.get('workload', '')}: {meta.get('agents', '?')} agents, "
                    f"{meta.get('duration_s', '?')} s, model {meta.get('model', '?')} "
                    f"(ratio = system / {ref})")
    t.add_column("figure")
    for name in report["policies"]:
        t.add_column(name, justify="right")
    for label, path, unit in FIGURES:
        cells = [
            _cell(get(figs, path), unit, figs["ratios"].get(_key(path)), name == ref)
            for name, figs in report["policies"].items()
        ]
        t.add_row(label, *cells)
    t.add_row("requests / errors", *[requests_cell(f) for f in report["policies"].values()])
    return t


def requests_cell(figures: dict[str, Any]) -> str:
    """``requests / errors``, and the replies that stopped short of ``max_tokens`` if any: every turn asks for
    ``ignore_eos``, so a system with short replies did less work than the others and its figures do not compare."""
    short = figures.get("short_replies", 0)
    return f"{figures['requests']} / {figures['errors']}" + (f" ({short} short)" if short else "")


def print_table(report: dict[str, Any], console: Console | None = None) -> None:
    (console or Console()).print(table(report))
