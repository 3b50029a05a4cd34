"""What every benchmark figure shares: one colour and marker per system, readable log axes, SLO lines.

A log axis gets labelled ticks inside the drawn range whatever that range is (1-2-5 steps, or every
integer multiple of the decade when the range is narrower than that), so values can be read off it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

# fixed per system, so a system has the same colour in every figure of every run
_COLOURS = {"agentserve": "#1f77b4", "fcfs": "#d62728", "chunked": "#2ca02c", "llamacpp": "#9467bd",
            "llama-server": "#8c564b", "no-feedback": "#ff7f0e", "no-partition": "#17becf", "target": "#7f7f7f"}
_SPARE = ["#e377c2", "#bcbd22", "#393b79", "#637939"]
_MARKERS = {"agentserve": "o", "fcfs": "s", "chunked": "^", "llamacpp": "v", "llama-server": "D",
            "no-feedback": "P", "no-partition": "X"}
SLO_STYLE = {"color": "black", "ls": "--", "lw": 1.0, "alpha": 0.8}


def style(name: str, index: int = 0) -> dict[str, str]:
    """Colour and marker of a system (``index`` picks a spare colour for names not known here)."""
    return {"color": _COLOURS.get(name, _SPARE[index % len(_SPARE)]), "marker": _MARKERS.get(name, "o")}


def log_ticks(lo: float, hi: float, min_ticks: int = 3) -> list[float]:
    """Tick values for a log axis over ``[lo, hi]``: decades, 1-2-5 steps or 1..9, the coarsest that gives
    enough labels (evenly spaced round values when the range is too narrow for any of them)."""
    if not (lo > 0 and hi > 0):
        raise ValueError(f"a log axis needs a positive range, got [{lo}, {hi}]")
    lo, hi = min(lo, hi), max(lo, hi)
    decades = range(math.floor(math.log10(lo)), math.floor(math.log10(hi)) + 1)
    # powers of ten alone over three decades or more; 1-2-5 steps; every multiple of the decade
    for mantissas, enough in (((1,), min_ticks + 1), ((1, 2, 5), min_ticks), (tuple(range(1, 10)), min_ticks)):
        ticks = [float(f"{m * 10.0 ** e:.6g}") for e in decades for m in mantissas
                 if lo <= m * 10.0 ** e <= hi * (1 + 1e-9)]
        if len(ticks) >= enough:
            return ticks
    return linear_ticks(lo, hi)  # narrower than a factor ~3: evenly spaced round values


def linear_ticks(lo: float, hi: float, target: int = 4) -> list[float]:
    """Round, evenly spaced values in ``[lo, hi]`` (steps of 1, 2, 2.5 or 5 × 10^k), about ``target`` of them."""
    raw = (hi - lo) / target
    base = 10.0 ** math.floor(math.log10(raw))
    step = next(m * base for m in (1, 2, 2.5, 5, 10) if m * base >= raw)
    first = math.ceil(lo / step)
    return [float(f"{k * step:.6g}") for k in range(first, math.floor(hi / step) + 1)]


def tick_label(value: float) -> str:
    """A tick value as a person writes it: 0.5, 20, 1500, 20k."""
    if value >= 10_000:
        return f"{value / 1000:g}k"
    return f"{value:g}"


def log_limits(lo: float, hi: float, pad: float = 1.05) -> tuple[float, float]:
    """Axis limits around ``[lo, hi]``: padded, then out to one significant digit (24 → 20, 2100 → 3000;
    two digits for a range under a decade), so the round values next to the data are on the axis."""
    digits = 1 if hi / lo >= 10 else 2
    lo, hi = lo / pad, hi * pad
    e_lo = 10.0 ** (math.floor(math.log10(lo)) - digits + 1)
    e_hi = 10.0 ** (math.floor(math.log10(hi)) - digits + 1)
    return float(f"{math.floor(lo / e_lo) * e_lo:.6g}"), float(f"{math.ceil(hi / e_hi - 1e-9) * e_hi:.6g}")


def readable_log_axis(ax, axis: str, values: Iterable[float]) -> None:
    """Make ``ax``'s ``axis`` ("x" or "y") logarithmic over ``values`` with labelled ticks in range."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    positive = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    if not positive:
        return
    lo, hi = log_limits(min(positive), max(positive))
    which = ax.xaxis if axis == "x" else ax.yaxis
    (ax.set_xlim if axis == "x" else ax.set_ylim)(lo, hi)  # limits first: no autoscale of a single point
    (ax.set_xscale if axis == "x" else ax.set_yscale)("log")
    which.set_major_locator(FixedLocator(log_ticks(lo, hi)))
    which.set_major_formatter(FuncFormatter(lambda v, _pos: tick_label(v)))
    which.set_minor_locator(NullLocator())


def slo_line(ax, value: float | None, axis: str, label: str) -> None:
    """Draw an SLO as a dashed line across ``ax`` (vertical for ``axis="x"``), labelled in the legend."""
    if value is None:
        return
    (ax.axvline if axis == "x" else ax.axhline)(value, label=label, **SLO_STYLE)
    if axis == "y":  # named on the line itself too: a panel without a legend still says what it is
        ax.text(0.995, value, label, transform=ax.get_yaxis_transform(), ha="right", va="bottom",
                fontsize="small", color=SLO_STYLE["color"])
