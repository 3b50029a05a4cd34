"""The sweep's JSON rows: SLO attainment and goodput worked out by hand, ratios, tables."""

from __future__ import annotations

import pytest
from bench_fakes import fake_figures, fake_point, fake_run, fake_sweep
from rich.console import Console

from agentserve.bench import runner, sweep_report
from agentserve.bench.metrics import SLO

SLO_HALF = SLO(ttft_s=0.5, tpot_s=0.1)
AS = "agentserve"


def _repeats():
    # repeat 1 (10 s): A meets both; B misses TTFT (0.8 s); C misses TPOT (0.2 s); D meets both
    one = fake_run([0.2, 0.8, 0.3, 0.4], [0.05, 0.05, 0.2, 0.09], elapsed=10.0)
    # repeat 2 (5 s, another clock): E meets both; F misses both
    two = fake_run([0.1, 0.6], [0.02, 0.3], elapsed=5.0, start=1000.0)
    return [one, two]


def test_attainment_and_goodput_pool_every_repeat():
    point, pooled = runner.point_report({"agentserve": _repeats()}, SLO_HALF,
                                        {"workload": "react", "agents": 2, "repeats": 2})
    row = sweep_report.row(point)
    figs = row["systems"]["agentserve"]
    assert row["agents"] == 2
    # A, D, E meet both of 6 requests; TTFT: A C D E; TPOT: A B D E
    assert figs["slo_attainment"] == pytest.approx(3 / 6)
    assert figs["ttft_slo_attainment"] == pytest.approx(4 / 6)
    assert figs["tpot_slo_attainment"] == pytest.approx(4 / 6)
    # goodput: 3 good requests over 10 + 5 s; throughput: 6 requests x 4 tokens over 15 s
    assert figs["goodput"] == pytest.approx(3 / 15)
    assert figs["throughput_tok_s"] == pytest.approx(24 / 15)
    # cold turns are the 1st of each run: A (0.2 s) and E (0.1 s); p95 by linear interpolation
    assert figs["ttft_cold_p95"] == pytest.approx(100.0 + 0.95 * 100.0)
    assert figs["ttft_cold_p50"] == pytest.approx(150.0)
    assert figs["ttft_resume_p50"] == pytest.approx(500.0)  # B C D F: 0.8, 0.3, 0.4, 0.6 s
    assert figs["requests"] == 6 and figs["errors"] == 0
    assert pooled["agentserve"].elapsed == pytest.approx(15.0)
    assert len(point["meta"]["per_repeat_ratios"]) == 2


def test_ratios_are_against_agentserve_and_a_system_missing_at_a_count_is_absent():
    sweep = fake_sweep({
        1: {"fcfs": fake_figures(0.8, 600.0, 60.0, 50.0), "agentserve": fake_figures(1.0, 200.0, 20.0, 100.0)},
        2: {"agentserve": fake_figures(0.9, 300.0, 30.0, 90.0)},
    }, failed={"2": ["fcfs"]})
    assert sweep["reference"] == "agentserve" and sweep["systems"] == ["fcfs", "agentserve"]
    assert sweep["meta"]["agents"] == [1, 2] and sweep["meta"]["failed"] == {"2": ["fcfs"]}
    r1, r2 = sweep["rows"]
    fcfs = r1["systems"]["fcfs"]
    assert fcfs["ratios"]["tpot_p95"] == pytest.approx(3.0)
    assert fcfs["ratios"]["throughput_tok_s"] == pytest.approx(0.5)
    assert fcfs["ratios"]["slo_attainment"] == pytest.approx(0.8)
    assert r1["systems"]["agentserve"]["ratios"]["ttft_p95"] == pytest.approx(1.0)
    assert "fcfs" not in r2["systems"]
    assert len(sweep["points"]) == 2 and sweep["points"][1]["meta"]["agents"] == 2


def test_the_sweep_meta_keeps_only_what_every_count_shares():
    one, two = fake_point(1, {AS: fake_figures()}), fake_point(2, {AS: fake_figures()})
    one["meta"]["per_repeat_ratios"] = [{AS: {"tpot_p95": 1.0}}]
    one["meta"]["failed"] = ["fcfs"]
    s = sweep_report.build([one, two], {"failed": {"1": ["fcfs"]}})
    assert "per_repeat_ratios" not in s["meta"] and s["meta"]["failed"] == {"1": ["fcfs"]}
    assert s["points"][0]["meta"]["per_repeat_ratios"] == [{AS: {"tpot_p95": 1.0}}]
    assert s["meta"]["agents"] == [1, 2] and s["meta"]["cpu_model"] == "Fake CPU 9000"


def test_a_single_count_report_reads_as_a_one_row_sweep():
    point = fake_point(4, {"agentserve": fake_figures(), "fcfs": fake_figures(0.5)})
    point["meta"]["failed"] = ["llama-server"]
    s = sweep_report.as_sweep(point)
    assert [r["agents"] for r in s["rows"]] == [4] and s["meta"]["agents"] == [4]
    assert s["meta"]["failed"] == {"4": ["llama-server"]}
    assert s["rows"][0]["systems"]["fcfs"]["slo_attainment"] == 0.5
    assert sweep_report.as_sweep(s) is s


def test_tables_show_every_system_with_its_ratio():
    sweep = fake_sweep({3: {"agentserve": fake_figures(0.95, 200.0, 20.0, 100.0),
                            "fcfs": fake_figures(0.40, 500.0, 50.0, 80.0)}})
    row = sweep["rows"][0]
    console = Console(record=True, width=250)
    console.print(sweep_report.headline_table(row, "agentserve", sweep["meta"]["slo"]))
    text = console.export_text()
    assert "3 agents" in text and "SLO TTFT 2000 ms" in text
    assert "40.0 %" in text and "(0.42×)" in text  # 0.40 / 0.95
    assert "(2.50×)" in text  # TPOT p95 50 / 20
    md = sweep_report.markdown_table(row, "agentserve")
    assert md.splitlines()[0].startswith("| system | SLO attainment (TTFT and TPOT) (%)")
    assert "| fcfs | 40.0 (0.42×) |" in md and "| agentserve | 95.0 |" in md


def test_a_count_where_agentserve_failed_names_the_reference_its_ratios_use():
    """Its ratios are against the first system that ran there; the tables must not call them "/ agentserve"."""
    sweep = fake_sweep({
        1: {"fcfs": fake_figures(0.8, 600.0, 60.0, 50.0), "agentserve": fake_figures(1.0, 200.0, 20.0, 100.0)},
        2: {"fcfs": fake_figures(0.8, 600.0, 60.0, 50.0), "chunked": fake_figures(0.7, 400.0, 40.0, 60.0)},
    }, failed={"2": ["agentserve"]})
    row = sweep["rows"][1]
    assert row["reference"] == "fcfs" and row["systems"]["chunked"]["ratios"]["tpot_p95"] == pytest.approx(40 / 60)
    console = Console(record=True, width=250)
    console.print(sweep_report.headline_table(row, sweep["reference"]))
    assert "system / fcfs" in console.export_text()
    md = sweep_report.markdown_table(row, sweep["reference"])
    assert "| fcfs | 80.0 |" in md and "ratios here are system / fcfs" in md
