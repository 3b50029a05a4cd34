"""Report: ratios to AgentServe, the JSON layout, the table, the plots."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from agentserve.bench import report
from agentserve.bench.metrics import SLO, RequestRecord, RunRecord, aggregate


def _figs(ttft_p95: float, tpot_p95: float, tput: float) -> dict:
    return {"ttft": {"p50": 1.0, "p95": ttft_p95, "p99": None}, "tpot": {"p95": tpot_p95},
            "throughput_tok_s": tput, "slo_attainment": 0.5, "goodput": 0.0, "requests": 3, "errors": 0}


def test_ratios_are_relative_to_agentserve_whatever_the_order():
    rep = report.build({"fcfs": _figs(300.0, 50.0, 90.0), "agentserve": _figs(100.0, 20.0, 100.0)},
                       {"workload": "react"})
    assert rep["reference"] == "agentserve"
    r = rep["policies"]["fcfs"]["ratios"]
    assert r["ttft_p95"] == pytest.approx(3.0)
    assert r["tpot_p95"] == pytest.approx(2.5)
    assert r["throughput_tok_s"] == pytest.approx(0.9)
    assert r["ttft_p99"] is None  # undefined figure
    assert r["goodput"] is None  # reference is zero
    assert rep["policies"]["agentserve"]["ratios"]["ttft_p95"] == pytest.approx(1.0)
    assert rep["meta"]["workload"] == "react" and "date" in rep["meta"]


def test_first_system_is_the_reference_without_agentserve():
    rep = report.build({"target": _figs(10.0, 1.0, 5.0), "other": _figs(20.0, 1.0, 5.0)}, {})
    assert rep["reference"] == "target"
    assert rep["policies"]["other"]["ratios"]["ttft_p95"] == pytest.approx(2.0)
    with pytest.raises(ValueError):
        report.build({}, {})


def _run() -> RunRecord:
    reqs = [RequestRecord(0, 0, 0, "cold", 30, 3, 0.0, [(0.5, 1), (0.6, 1), (0.7, 1)]),
            RequestRecord(0, 0, 1, "resume", 5, 3, 1.0, [(1.1, 1), (1.3, 2)])]
    return RunRecord(0.0, 2.0, reqs)


def test_json_and_table_from_real_aggregates(tmp_path):
    figs = aggregate(_run(), SLO(1.0, 0.1))
    rep = report.build({"agentserve": figs, "fcfs": figs}, {"agents": 1})
    path = tmp_path / "out.json"
    report.write_json(rep, path)
    data = json.loads(path.read_text())
    for name in ("agentserve", "fcfs"):
        p = data["policies"][name]
        assert set(p["ttft"]) >= {"p50", "p95", "p99"} and set(p["tpot"]) >= {"p50", "p95", "p99"}
        assert {"throughput_tok_s", "slo_attainment", "goodput", "ratios"} <= set(p)
    assert data["policies"]["fcfs"]["ratios"]["tpot_p95"] == pytest.approx(1.0)
    console = Console(record=True, width=200)
    report.print_table(rep, console)
    text = console.export_text()
    assert "TPOT p95" in text and "fcfs" in text and "(1.00×)" in text
    for row in ("TTFT cold p50", "TTFT cold p95", "TTFT resume p50", "TTFT resume p95"):  # the acceptance figures
        assert row in text
    # throughput: 6 tokens in 2 s
    assert "3 tok/s" in text


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from agentserve.bench.plots import plot

    out = tmp_path / "p.png"
    plot({"agentserve": _run(), "fcfs": _run()}, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
