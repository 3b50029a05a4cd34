"""``paper.md``: the paper's claims beside what a sweep measured, from the sweep JSON files alone.

``agentserve bench --report DIR`` reads every bench JSON in ``DIR`` (sweeps or single-count reports)
and writes one section per file: the command, the dates, the machine (CPU model and flags as the run
recorded them), the claims table (:mod:`agentserve.bench.paper_claims`), a table per agent count and
the figures the run drew. Every number in it is read from a JSON file; a claim the sweep cannot speak
to says "not measured" and why.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from agentserve.bench import machine
from agentserve.bench.paper_claims import (
    ABLATIONS,
    BELOW,
    CLAIMS,
    NEAR_FULL,
    REFERENCE,
    SLO_CLAIM,
    SYSTEMS,
    Claim,
    Verdict,
    factor,
    factors,
    figure,
    grade,
)
from agentserve.bench.sweep_report import BY_KEY, as_sweep, fmt, markdown_table, number


def _values(sweep: dict[str, Any], agents: int, system: str, key: str) -> str:
    unit = BY_KEY[key].unit
    ours, theirs = figure(sweep, agents, REFERENCE, key), figure(sweep, agents, system, key)
    return f"{BY_KEY[key].label} at {agents} agents: {REFERENCE} {fmt(ours, unit)}, {system} {fmt(theirs, unit)}"


# figures that explain a claim's figure: TTFT splits into cold and resume turns, and so on
EXPLAINED_BY = {"ttft_p95": ("ttft_cold_p95", "ttft_resume_p95"), "tpot_p95": ("tpot_p50",),
                "tpot_std": ("ttft_std",), "throughput_tok_s": ("slo_attainment",)}


def _reason(sweep: dict[str, Any], claim: Claim, system: str, agents: int) -> str:
    parts = [_values(sweep, agents, system, claim.metric)]
    for key in EXPLAINED_BY.get(claim.metric, ()):
        f = factor(sweep, agents, system, key)
        if f is not None:
            parts.append(f"{BY_KEY[key].label} {f:.2f}×")
    failed = _failures(sweep, system)
    if failed:
        parts.append(f"{system} failed at {', '.join(failed)} agents")
    return "; ".join(parts)


def _failures(sweep: dict[str, Any], system: str) -> list[str]:
    return [n for n, names in (sweep["meta"].get("failed") or {}).items() if system in names]


def _why_absent(sweep: dict[str, Any], systems: tuple[str, ...]) -> str:
    tried = {s: _failures(sweep, s) for s in systems if _failures(sweep, s)}
    if tried:
        return "; ".join(f"{s} failed at {', '.join(n)} agents" for s, n in tried.items())
    return f"the sweep did not run {' or '.join(systems)}"


def _measured(fs: dict[int, float], agents: int) -> str:
    text = f"{fs[agents]:.2f}× at {agents} agents"
    if len(fs) > 1:
        text += f" ({min(fs.values()):.2f}–{max(fs.values()):.2f}× over {', '.join(map(str, fs))} agents)"
    return text


def judge(claim: Claim, sweep: dict[str, Any]) -> list[Verdict]:
    """The rows of one ratio claim: one per stand-in the sweep ran, or one "not measured"."""
    def absent(system: str, reason: str) -> Verdict:
        return Verdict(claim.text, claim.paper, system, "not measured", "not measured", reason)

    if claim.missing:
        return [absent("–", claim.missing)]
    if REFERENCE not in sweep["systems"]:
        return [absent(" / ".join(claim.systems), f"the sweep did not run {REFERENCE}")]
    ran = [s for s in claim.systems if s in sweep["systems"]]
    if not ran:
        return [absent(" / ".join(claim.systems), _why_absent(sweep, claim.systems))]
    out = []
    for system in ran:
        fs = factors(sweep, system, claim.metric)
        if not fs:
            out.append(absent(system, f"no {BY_KEY[claim.metric].label} of both systems at any agent count"))
            continue
        agents = max(fs, key=fs.__getitem__) if claim.best else max(fs)
        verdict = grade(fs[agents], claim.low, claim.high)
        out.append(Verdict(claim.text, claim.paper, system, _measured(fs, agents), verdict,
                           _reason(sweep, claim, system, agents)))
    return out


def judge_slo(sweep: dict[str, Any]) -> Verdict:
    """The SLO claim at the largest agent count AgentServe ran: it near 100 %, a baseline below 50 %."""
    text, paper = SLO_CLAIM
    counts = [r["agents"] for r in sweep["rows"] if REFERENCE in r["systems"]]
    if not counts:
        return Verdict(text, paper, "–", "not measured", "not measured", f"the sweep did not run {REFERENCE}")
    n = max(counts)
    row = next(r for r in sweep["rows"] if r["agents"] == n)
    others = {s: f for s, f in row["systems"].items() if s != REFERENCE and s not in ABLATIONS}
    if not others:
        return Verdict(text, paper, "–", "not measured", "not measured", f"no baseline ran at {n} agents")
    ours = row["systems"][REFERENCE]["slo_attainment"] or 0.0
    worst = min(others, key=lambda s: others[s]["slo_attainment"] or 0.0)
    low = others[worst]["slo_attainment"] or 0.0
    measured = f"at {n} agents: {REFERENCE} {fmt(ours, '%')}; " + ", ".join(
        f"{s} {fmt(f['slo_attainment'], '%')}" for s, f in others.items())
    if ours >= NEAR_FULL and low < BELOW:
        verdict = "reproduced"
    elif ours >= NEAR_FULL:
        verdict = "partly (AgentServe near 100 %, but no baseline falls below 50 %)"
    elif ours > max(f["slo_attainment"] or 0.0 for f in others.values()):
        verdict = "partly (AgentServe ahead of every baseline, but below 90 %)"
    else:
        verdict = "not reproduced"
    split = "; ".join(f"{s}: TTFT SLO {fmt(row['systems'][s]['ttft_slo_attainment'], '%')}, TPOT SLO "
                      f"{fmt(row['systems'][s]['tpot_slo_attainment'], '%')}" for s in (REFERENCE, worst))
    return Verdict(text, paper, ", ".join(others), measured, verdict, split)


def claims_table(sweep: dict[str, Any]) -> str:
    ablation = [c for c in CLAIMS if set(c.systems) & set(ABLATIONS)]
    rows = [v for c in CLAIMS if c not in ablation for v in judge(c, sweep)] + [judge_slo(sweep)]
    rows += [v for c in ablation for v in judge(c, sweep)]
    lines = ["| the paper's claim | paper | compared with | measured here | verdict | what we measured |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {v.claim} | {v.paper} | {v.system} | {v.measured} | {v.verdict} | {v.reason} |" for v in rows]
    return "\n".join(lines)


def _plot_links(sweep: dict[str, Any], json_path: Path, out_dir: Path) -> list[str]:
    links = []
    for name, rel in (sweep["meta"].get("plots") or {}).items():
        path = (json_path.parent / rel).resolve()
        if path.is_file():
            links.append(f"![{name}]({os.path.relpath(path, out_dir.resolve())})")
    return links



def _load(values: Any) -> str:
    return ", ".join(f"{v:.2f}" for v in values) if isinstance(values, list) else "not recorded"


def _facts(sweep: dict[str, Any]) -> list[str]:
    meta = sweep["meta"]
    slo = meta.get("slo") or {}
    failed = meta.get("failed") or {}
    load_end = f" → {_load(meta['loadavg_end'])}" if meta.get("loadavg_end") else ""
    return [
        f"- command: `{meta.get('command') or 'not recorded'}`",
        f"- date: {meta.get('date', 'not recorded')}" + (f" → {meta['finished']}" if meta.get("finished") else ""),
        f"- machine: {machine.one_line(meta)}",
        f"- load average (1, 5, 15 min) at the start{' / end' if load_end else ''}: "
        f"{_load(meta.get('loadavg_1_5_15'))}{load_end}",
        f"- model {meta.get('model', '?')}; {number(meta.get('warmup_s'))} s warm-up + "
        f"{number(meta.get('duration_s'))} s measured, {meta.get('repeats', 1)} interleaved repeat(s) per system "
        f"and agent count; SLO TTFT {number(slo.get('ttft_ms'))} ms, TPOT {number(slo.get('tpot_ms'))} ms",
        f"- agent counts: {', '.join(str(r['agents']) for r in sweep['rows'])}; systems: "
        + ", ".join(f"`{s}` ({SYSTEMS.get(s, 'AgentServe') if s != REFERENCE else 'the reference'})"
                    for s in sweep["systems"]),
        "- failed: " + ("; ".join(f"{', '.join(v)} at {k} agents" for k, v in failed.items()) or "none"),
    ]


def section(sweep: dict[str, Any], json_path: Path, out_dir: Path) -> str:
    """The Markdown section of one bench JSON."""
    meta = sweep["meta"]
    parts = [f"## {meta.get('workload', json_path.stem)} (`{json_path.name}`)", "", *_facts(sweep), "",
             "### The paper's claims", "", claims_table(sweep), "", "### Per agent count", "",
             f"Ratios in brackets: system / {sweep['reference']} (above 1 for a latency: slower than "
             f"{sweep['reference']}; below 1 for attainment, goodput or throughput: less).", ""]
    for row in sweep["rows"]:
        parts += [f"#### {row['agents']} agent{'s' if row['agents'] != 1 else ''}", "",
                  markdown_table(row, sweep["reference"]), ""]
    links = _plot_links(sweep, json_path, out_dir)
    if links:
        parts += ["### Figures", "", *links, ""]
    return "\n".join(parts)


HEADER = """# AgentServe against the paper's claims

The AgentServe paper (arXiv 2603.10342) claims, against its baselines: TTFT up to 2.8× better (vs llama.cpp;
1.5–1.8× vs vLLM, 1.1–1.3× vs SGLang), TPOT p95 up to 2.7× better, throughput 2.0–2.2× vs llama.cpp and
1.2–1.5× vs vLLM / SGLang, SLO attainment near 100 % where the baselines fall below 50 %; and in ablations,
TPOT p95 ~1.4× worse without the feedback algorithm, TTFT and latency variance +20–30 % without green
contexts. Below, each claim beside the figure measured here.

How to read it. A factor is how many times better AgentServe is: other / AgentServe for a latency,
AgentServe / other for throughput. TTFT is the p95 of all turns (its cold and resume parts are given
beside it); "latency variance" is the standard deviation of TPOT. "Up to" claims are judged on the best
agent count, the others at the largest count both systems ran. Verdicts: reproduced (at least the
paper's lower figure), partly (better by less), not reproduced (within 5 % of no difference, or worse),
not measured (the sweep lacks the system, and why). The paper measured on GPUs (RTX A5000, RTX 5090);
every figure below is this machine's, as recorded in the JSON files named.
"""


def load(path: Path) -> dict[str, Any] | None:
    """A bench JSON as a sweep, or None when ``path`` is not a bench report."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or "meta" not in data or not ("rows" in data or "policies" in data):
        return None
    return as_sweep(data)


def render(reports: list[tuple[Path, dict[str, Any]]], out_dir: Path) -> str:
    names = ", ".join(f"`{p.name}`" for p, _ in reports)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    intro = f"Written by `agentserve bench --report` on {when} from {names}.\n"
    return "\n".join([HEADER, intro, *(section(s, p, out_dir) for p, s in reports)]).rstrip() + "\n"


def write_report(folder: Path, out: Path | None = None) -> Path:
    """Write ``paper.md`` (or ``out``) from every bench JSON in ``folder``; returns its path."""
    reports = [(p, s) for p in sorted(folder.glob("*.json")) if (s := load(p)) is not None]
    if not reports:
        raise ValueError(f"no bench JSON (agentserve bench --json) in {folder}")
    out = out or folder / "paper.md"
    out.write_text(render(reports, out.parent), encoding="utf-8")
    return out
