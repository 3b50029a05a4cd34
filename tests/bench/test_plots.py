"""Plots a person can read: labelled log ticks in range, shared axes where systems compare, SLOs drawn."""

from __future__ import annotations

import math
import random

import pytest
from bench_fakes import fake_figures, fake_run, fake_sweep
from hypothesis import given
from hypothesis import strategies as st

from agentserve.bench.metrics import SLO
from agentserve.bench.plot_style import log_limits, log_ticks, tick_label

matplotlib = pytest.importorskip("matplotlib")
PNG = b"\x89PNG\r\n\x1a\n"


@given(lo=st.floats(1e-3, 1e6), ratio=st.floats(1.01, 1e5))
def test_log_ticks_lie_in_range_and_read_differently(lo, ratio):
    hi = lo * ratio
    ticks = log_ticks(lo, hi)
    assert len(ticks) >= 2
    assert all(lo * (1 - 1e-9) <= t <= hi * (1 + 1e-9) for t in ticks)
    assert ticks == sorted(set(ticks))
    labels = [tick_label(t) for t in ticks]
    assert len(set(labels)) == len(labels)


@given(lo=st.floats(1e-3, 1e6), ratio=st.floats(1.0, 1e5))
def test_log_limits_hold_the_data_and_waste_little(lo, ratio):
    hi = lo * ratio
    a, b = log_limits(lo, hi)
    assert a <= lo / 1.05 * (1 + 1e-9) and b >= hi * 1.05 * (1 - 1e-9)
    assert a >= lo / 1.05 / 2 - 1e-12 and b <= hi * 1.05 * 2  # rounding out costs at most a factor 2 a side
    assert len(log_ticks(a, b)) >= 2


def test_log_ticks_of_a_range_without_a_decade_inside():
    assert log_ticks(15, 60) == [20, 30, 40, 50, 60]
    assert log_ticks(13, 2000) == [20, 50, 100, 200, 500, 1000, 2000]
    assert log_ticks(1, 1e5) == [1, 10, 100, 1000, 10000, 100000]
    assert tick_label(20000) == "20k" and tick_label(0.5) == "0.5"
    with pytest.raises(ValueError):
        log_ticks(0, 10)


def _visible_labels(ax, axis: str) -> list[float]:
    ax.figure.canvas.draw()
    lo, hi = ax.get_xlim() if axis == "x" else ax.get_ylim()
    labels = ax.get_xticklabels() if axis == "x" else ax.get_yticklabels()
    out = []
    for label in labels:
        text = label.get_text().replace("k", "e3")
        x, y = label.get_position()
        pos = x if axis == "x" else y
        if text and lo <= pos <= hi:
            assert float(text) == pytest.approx(pos, rel=1e-6)  # the label says where it sits
            out.append(pos)
    return out


def _runs():
    rng = random.Random(5)
    # TPOTs of 15-60 ms: no power of ten inside, where the old axis showed no label at all
    calm = fake_run([rng.uniform(0.05, 0.4) for _ in range(60)], [rng.uniform(0.015, 0.06) for _ in range(60)])
    # the other system stalls up to 2 s: ten times the first one's worst
    stalls = fake_run([rng.uniform(0.05, 3.0) for _ in range(60)], [rng.choice([0.02, 0.5, 2.0]) for _ in range(60)])
    return {"agentserve": calm, "fcfs": stalls}


def _by_title(fig, fragment: str):
    return [ax for ax in fig.axes if fragment in ax.get_title(loc="center") + ax.get_title(loc="left")]


def test_detail_figure_has_readable_cdf_axes_with_the_slo():
    from agentserve.bench.plots import figure

    runs = {"agentserve": _runs()["agentserve"]}
    fig = figure(runs, SLO(2.0, 0.1))
    (tpot,) = _by_title(fig, "TPOT CDF")
    ticks = _visible_labels(tpot, "x")
    assert len(ticks) >= 3
    assert min(ticks) < 30 and max(ticks) >= 60  # labels across the data's range, not only at its ends
    assert "SLO 100 ms" in [line.get_label() for line in tpot.get_lines()]
    (cold,) = _by_title(fig, "TTFT of cold turns")
    assert "SLO 2000 ms" in [line.get_label() for line in cold.get_lines()]
    assert cold.get_xlabel() == "TTFT of cold turns (ms, log scale)" and cold.get_ylabel() == "fraction of requests"
    matplotlib.pyplot.close(fig)


def test_timelines_share_both_axes_across_systems():
    from agentserve.bench.plots import figure

    fig = figure(_runs(), SLO(2.0, 0.1))
    a, f = _by_title(fig, "over time")
    assert a.get_ylim() == f.get_ylim() and a.get_xlim() == f.get_xlim()
    lo, hi = a.get_ylim()
    assert lo < 15 and hi > 2000  # both systems' range, and the SLO
    assert len(_visible_labels(a, "y")) >= 3 and _visible_labels(a, "y") == _visible_labels(f, "y")
    assert all("TPOT SLO 100 ms" in [line.get_label() for line in ax.get_lines()] for ax in (a, f))
    assert f.get_xlabel().startswith("time") and a.get_ylabel().startswith("latency (ms")
    matplotlib.pyplot.close(fig)


def _sweep():
    return fake_sweep({
        1: {"agentserve": fake_figures(1.0, 200.0, 20.0, 60.0), "fcfs": fake_figures(0.9, 300.0, 40.0, 55.0)},
        2: {"agentserve": fake_figures(0.97, 250.0, 22.0, 70.0)},
        4: {"agentserve": fake_figures(0.93, 320.0, 25.0, 80.0), "fcfs": fake_figures(0.45, 900.0, 120.0, 62.0)},
    }, failed={"2": ["fcfs"]})


def test_sweep_figure_draws_every_headline_against_the_agent_count():
    from agentserve.bench.sweep_plots import figure, series

    sweep = _sweep()
    fig = figure(sweep)
    assert len(fig.axes) == 8
    for ax in fig.axes:
        assert list(ax.get_xticks()) == [1, 2, 4]
        assert ax.get_xlabel() == "concurrent agents" and ax.get_ylabel() and ax.get_title()
    (att,) = _by_title(fig, "SLO attainment (TTFT and TPOT)")
    assert att.get_ylim() == (0, 105)
    fcfs = next(line for line in att.get_lines() if line.get_label() == "fcfs")
    ys = list(fcfs.get_ydata())
    assert ys[0] == pytest.approx(90.0) and math.isnan(ys[1]) and ys[2] == pytest.approx(45.0)  # the gap
    (tpot,) = _by_title(fig, "TPOT p95")
    slo = [line for line in tpot.get_lines() if line.get_label() == "SLO 100 ms"]
    assert slo and list(slo[0].get_ydata()) == [100, 100]
    assert len(_visible_labels(tpot, "y")) >= 3
    cold, resume = _by_title(fig, "TTFT cold p95")[0], _by_title(fig, "TTFT resume p95")[0]
    assert cold.get_ylim() == resume.get_ylim()
    assert series(sweep, "fcfs", "tpot_p95") == ([1, 2, 4], [40.0, None, 120.0])
    matplotlib.pyplot.close(fig)


def test_both_figures_are_written_as_png(tmp_path):
    from agentserve.bench import plots, sweep_plots

    plots.plot(_runs(), tmp_path / "d.png", SLO(), "title")
    sweep_plots.plot(_sweep(), tmp_path / "s.png")
    assert (tmp_path / "d.png").read_bytes()[:8] == PNG and (tmp_path / "s.png").read_bytes()[:8] == PNG
