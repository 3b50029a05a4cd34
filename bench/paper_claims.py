"""The AgentServe paper's claims (arXiv 2603.10342, as its summaries quote them) and how each is judged
against a sweep's JSON.

A claim compares AgentServe with other systems on one headline figure. Its *factor* is how many times
better AgentServe is: ``other / agentserve`` for a latency, ``agentserve / other`` for throughput or
attainment, so the paper's "2.8× better" and an ablation's "1.4× worse without it" read the same way.
"Up to" claims are judged on the best agent count; the others at the largest agent count both ran.
Nothing here holds a measured number: every figure comes from the sweep passed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentserve.bench.sweep_report import BY_KEY

REFERENCE = "agentserve"

# what each of our systems stands in for
SYSTEMS = {
    "llama-server": "llama.cpp's own server, same weights as GGUF",
    "llamacpp": "llama.cpp's scheduling emulated in this engine",
    "chunked": "vLLM-style chunked prefill, in this engine",
    "fcfs": "first come, first served (not one of the paper's baselines)",
    "no-feedback": "AgentServe without the TPOT feedback controller",
    "no-partition": "AgentServe without the partition (green contexts on a GPU, core split on a CPU)",
    "target": "an external server (`--target`), whatever it runs",
}
ABLATIONS = ("no-feedback", "no-partition")
NEAR_FULL = 0.9  # "near 100 %" SLO attainment
BELOW = 0.5  # "baselines fall below 50 %"
SAME_BAND = 0.05  # a factor within 5 % of 1 is no difference


@dataclass(frozen=True)
class Claim:
    """A ratio claim: AgentServe is ``low``(–``high``)× better than ``systems`` on ``metric``."""

    text: str
    paper: str
    metric: str  # a key of sweep_report.HEADLINE
    systems: tuple[str, ...]  # our stand-ins, in order of preference; each measured one gets a row
    low: float
    high: float | None = None
    best: bool = False  # True: judged on the best agent count ("up to"); False: at the largest
    missing: str = ""  # why it cannot be measured at all here (no stand-in exists)


CLAIMS: list[Claim] = [
    Claim("TTFT better than llama.cpp", "up to 2.8×", "ttft_p95", ("llama-server", "llamacpp"), 2.8, best=True),
    Claim("TTFT better than vLLM", "1.5–1.8×", "ttft_p95", ("chunked",), 1.5, 1.8),
    Claim("TTFT better than SGLang", "1.1–1.3×", "ttft_p95", (), 1.1, 1.3,
          missing="no stand-in for SGLang's prefill/decode disaggregation in this engine"),
    Claim("TPOT p95 better than the baselines", "up to 2.7×", "tpot_p95",
          ("llama-server", "llamacpp", "chunked", "fcfs"), 2.7, best=True),
    Claim("throughput above llama.cpp", "2.0–2.2×", "throughput_tok_s", ("llama-server", "llamacpp"), 2.0, 2.2),
    Claim("throughput above vLLM / SGLang", "1.2–1.5×", "throughput_tok_s", ("chunked",), 1.2, 1.5),
    Claim("ablation: without the feedback algorithm TPOT p95 is worse", "~1.4×", "tpot_p95", ("no-feedback",),
          1.4),
    Claim("ablation: without green contexts (the partition) TTFT rises", "+20–30 % (1.2–1.3×)", "ttft_p95",
          ("no-partition",), 1.2, 1.3),
    Claim("ablation: without green contexts (the partition) latency variance rises", "+20–30 % (1.2–1.3×)",
          "tpot_std", ("no-partition",), 1.2, 1.3),
]
SLO_CLAIM = ("SLO attainment near 100 % where the baselines fall below 50 %",
             "≈ 100 % (> 80 % on the A5000) vs < 50 %")


@dataclass
class Verdict:
    """One row of the claims table: what we compared, the figure measured, the verdict and its reason."""

    claim: str
    paper: str
    system: str
    measured: str
    verdict: str
    reason: str


def figure(sweep: dict[str, Any], agents: int, system: str, key: str) -> float | None:
    for r in sweep["rows"]:
        if r["agents"] == agents and system in r["systems"]:
            return r["systems"][system].get(key)
    return None


def factor(sweep: dict[str, Any], agents: int, system: str, key: str) -> float | None:
    """How many times better AgentServe is than ``system`` on ``key`` at ``agents`` (None: undefined)."""
    ours, theirs = figure(sweep, agents, REFERENCE, key), figure(sweep, agents, system, key)
    if ours is None or theirs is None:
        return None
    lower_better = BY_KEY[key].better == "lower"
    num, den = (theirs, ours) if lower_better else (ours, theirs)
    return num / den if den > 0 else None


def factors(sweep: dict[str, Any], system: str, key: str) -> dict[int, float]:
    """The factor at every agent count where it is defined."""
    out = {}
    for r in sweep["rows"]:
        f = factor(sweep, r["agents"], system, key)
        if f is not None:
            out[r["agents"]] = f
    return out


def grade(value: float, low: float, high: float | None = None) -> str:
    """The verdict for a factor against the paper's figure (``low``, or the range ``low``–``high``)."""
    if value >= low:
        above = high is not None and value > high * (1 + SAME_BAND)
        return "reproduced (above the paper's range)" if above else "reproduced"
    if value >= 1 + SAME_BAND:
        return "partly: AgentServe ahead, by less than the paper's figure"
    if value > 1 - SAME_BAND:
        return "not reproduced: no difference (within 5 %)"
    return "not reproduced: AgentServe behind"
