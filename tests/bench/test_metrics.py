"""Metric computations on hand-made timelines; every expected number is worked out by hand."""

from __future__ import annotations

import pytest

from agentserve.bench.metrics import (
    SLO,
    RequestRecord,
    RunRecord,
    TaskRecord,
    after_warmup,
    aggregate,
    pool,
    summary,
)


def _req(sent, chunks, kind="resume", agent=0, task=0, step=1, error=None):
    return RequestRecord(agent, task, step, kind, 50, 8, sent, list(chunks), error)


def test_ttft_tpot_e2e_itl_of_one_request():
    # sent at 10.0; tokens at 10.5, 10.6, 10.8 (a chunk of 2 tokens), 11.1
    r = _req(10.0, [(10.5, 1), (10.6, 1), (10.8, 2), (11.1, 1)])
    assert r.n_tokens == 5
    assert r.ttft == pytest.approx(0.5)
    assert r.e2e == pytest.approx(1.1)
    # (E2E - TTFT) / (n - 1) = (1.1 - 0.5) / 4 = 0.15
    assert r.tpot == pytest.approx(0.15)
    # one gap per chunk: 0.1, 0.2, 0.3
    assert r.itls == pytest.approx([0.1, 0.2, 0.3])


def test_single_token_request_has_no_tpot_and_is_judged_on_ttft():
    r = _req(0.0, [(0.3, 1)])
    assert r.tpot is None and r.itls == []
    assert SLO(ttft_s=0.5, tpot_s=0.001).met(r)
    assert not SLO(ttft_s=0.2, tpot_s=1.0).met(r)


def test_summary_percentiles_interpolate_linearly():
    s = summary([1.0, 2.0, 3.0, 4.0, 5.0], scale=1000.0)
    # p95 of 5 values: rank 0.95 * 4 = 3.8 -> 4 + 0.8 * (5 - 4) = 4.8
    # std: deviations -2, -1, 0, 1, 2 (x1000) -> sqrt(10 / 5) * 1000
    assert s == {"count": 5, "mean": 3000.0, "p50": 3000.0, "p95": pytest.approx(4800.0),
                 "p99": pytest.approx(4960.0), "std": pytest.approx(2 ** 0.5 * 1000.0)}
    assert summary([])["p95"] is None


def test_aggregate_slo_attainment_goodput_and_throughput():
    reqs = [
        # A: TTFT 0.2, TPOT (0.5 - 0.2) / 3 = 0.1      -> meets both (TPOT SLO 0.1 is inclusive)
        _req(0.0, [(0.2, 1), (0.3, 1), (0.4, 1), (0.5, 1)], kind="cold"),
        # B: TTFT 1.0, TPOT (1.3 - 1.0) / 2 = 0.15     -> fails both
        _req(1.0, [(2.0, 1), (2.1, 1), (2.3, 1)], agent=1),
        # C: TTFT 0.1, TPOT (0.9 - 0.1) / 2 = 0.4      -> TTFT ok, TPOT not
        _req(3.0, [(3.1, 2), (3.9, 1)], agent=2),
        # D: TTFT 0.9 > 0.5, TPOT 0.05                  -> TPOT ok, TTFT not
        _req(4.0, [(4.9, 1), (4.95, 1)], agent=3),
        # E: failed: excluded from latencies, counted as an error and as a miss of both SLOs
        _req(5.0, [(5.5, 1)], error="boom"),
    ]
    tasks = [TaskRecord(0, 0, 0.0, 8.0), TaskRecord(1, 0, 1.0, 5.0), TaskRecord(2, 0, 3.0, None)]
    run = RunRecord(start=0.0, end=10.0, requests=reqs, tasks=tasks)
    m = aggregate(run, SLO(ttft_s=0.5, tpot_s=0.1))
    assert m["requests"] == 4 and m["errors"] == 1
    assert m["slo_attainment"] == pytest.approx(1 / 5)
    assert m["ttft_slo_attainment"] == pytest.approx(2 / 5)
    assert m["tpot_slo_attainment"] == pytest.approx(2 / 5)
    # goodput: 1 request met both SLOs in 10 s
    assert m["goodput"] == pytest.approx(0.1)
    # output tokens 4 + 3 + 3 + 2 = 12 over 10 s
    assert m["output_tokens"] == 12
    assert m["throughput_tok_s"] == pytest.approx(1.2)
    assert m["request_throughput"] == pytest.approx(0.4)
    # TTFTs 200, 1000, 100, 900 ms: mean 550, median (200 + 900) / 2 = 550
    assert m["ttft"]["mean"] == pytest.approx(550.0) and m["ttft"]["p50"] == pytest.approx(550.0)
    assert m["ttft_cold"]["count"] == 1 and m["ttft_cold"]["p50"] == pytest.approx(200.0)
    assert m["ttft_resume"]["count"] == 3
    # TPOTs 100, 150, 400, 50 ms: mean 175; sorted 50,100,150,400 -> p50 125, p95 at rank 2.85 -> 362.5
    assert m["tpot"]["mean"] == pytest.approx(175.0)
    assert m["tpot"]["p50"] == pytest.approx(125.0)
    assert m["tpot"]["p95"] == pytest.approx(362.5)
    # ITLs: A 0.1,0.1,0.1; B 0.1,0.2; C 0.8; D 0.05 -> 7 gaps, mean 1.45 / 7 s
    assert m["itl"]["count"] == 7
    assert m["itl"]["mean"] == pytest.approx(1450.0 / 7)
    # tasks: 8 s and 4 s completed, one cut off
    assert m["tasks_completed"] == 2
    assert m["task_time_s"]["mean"] == pytest.approx(6.0)


def test_a_server_that_fails_requests_does_not_gain_attainment_by_it():
    fast = [_req(float(i), [(i + 0.1, 1), (i + 0.15, 1)]) for i in range(4)]
    healthy = aggregate(RunRecord(0.0, 10.0, fast), SLO(ttft_s=0.5, tpot_s=0.1))
    failing = aggregate(RunRecord(0.0, 10.0, fast[:1] + [_req(float(i), [], error="503") for i in range(1, 4)]),
                        SLO(ttft_s=0.5, tpot_s=0.1))
    assert healthy["slo_attainment"] == 1.0
    assert failing["slo_attainment"] == failing["ttft_slo_attainment"] == failing["tpot_slo_attainment"] == 0.25


def test_aggregate_of_an_empty_run_is_well_defined():
    m = aggregate(RunRecord(0.0, 1.0), SLO())
    assert m["requests"] == 0 and m["slo_attainment"] == 0.0 and m["goodput"] == 0.0
    assert m["tpot"]["p95"] is None


def test_after_warmup_keeps_what_started_in_the_measured_window():
    reqs = [_req(1.0, [(2.5, 1)]), _req(3.0, [(3.5, 1)]), _req(6.0, [(7.0, 2)])]
    tasks = [TaskRecord(0, 0, 1.0, 4.0), TaskRecord(0, 1, 6.0, None)]
    run = after_warmup(RunRecord(0.0, 10.0, reqs, tasks), 2.0)
    assert (run.start, run.end) == (2.0, 10.0)
    assert [r.sent for r in run.requests] == [3.0, 6.0]
    assert [t.task for t in run.tasks] == [1]
    assert [r.sent for r in run.earlier] == [1.0]
    # throughput over the 8 s window: the 4 tokens that arrived in it, one of a request sent in the warm-up
    m = aggregate(run, SLO())
    assert m["throughput_tok_s"] == pytest.approx(4 / 8) and m["output_tokens"] == 4
    assert m["requests"] == 2 and m["request_throughput"] == pytest.approx(3 / 8)  # finished in it: all three


def test_rates_divide_by_the_window_asked_for_not_the_drain_after_it():
    """Two systems in a 10 s window (2 s of it warm-up) whose last turn starts at 9.9 s: the one that finishes it
    5 s past the deadline counts only the token it streamed in the window and divides by the window, not by the
    12.9 s until its last token; repeats pool their windows."""
    def run(drain: float) -> RunRecord:
        reqs = [_req(1.0, [(1.5, 4)]), _req(3.0, [(3.5, 4)]), _req(9.9, [(9.95, 1), (9.9 + drain, 7)])]
        return RunRecord(0.0, max(10.0, 9.9 + drain), reqs, window_s=10.0)

    prompt, slow = (aggregate(after_warmup(run(d), 2.0), SLO(ttft_s=9.0, tpot_s=1.0)) for d in (0.1, 5.0))
    assert prompt["throughput_tok_s"] == pytest.approx(12 / 8) and slow["throughput_tok_s"] == pytest.approx(5 / 8)
    assert prompt["goodput"] == pytest.approx(2 / 8) and slow["goodput"] == pytest.approx(1 / 8)
    assert prompt["slo_attainment"] == slow["slo_attainment"] == 1.0  # both turns sent in the window met both
    assert slow["elapsed_s"] == pytest.approx(12.9) and slow["measured_s"] == pytest.approx(8.0)
    pooled = pool([after_warmup(run(0.1), 2.0), after_warmup(run(5.0), 2.0)])
    assert pooled.measured_s == pytest.approx(16.0)
    assert aggregate(pooled, SLO())["throughput_tok_s"] == pytest.approx(17 / 16)
    with pytest.raises(ValueError):
        after_warmup(pooled, 1.0)


def test_rates_are_exact_without_a_warm_up():
    """Closed loop, one agent, turns of 4 tokens back to back, one a second, over a 9.5 s window: the last is in
    flight at the deadline and counts only the 2 tokens it streamed before it, so the token rate is the steady
    4 a second (counting the 10 turns sent in the window with all their tokens gave 40 / 9.5 = 4.2)."""
    reqs = [_req(float(i), [(i + 0.5, 2), (i + 1.0, 2)]) for i in range(10)]
    m = aggregate(RunRecord(0.0, 10.0, reqs, window_s=9.5), SLO(ttft_s=1.0, tpot_s=1.0))
    assert m["throughput_tok_s"] == pytest.approx(4.0) and m["output_tokens"] == 38
    assert m["request_throughput"] == pytest.approx(9 / 9.5) and m["goodput"] == pytest.approx(9 / 9.5)
    assert m["requests"] == 10  # the latencies: of every turn sent in the window


def test_pooled_runs_lie_end_to_end_and_aggregate_over_every_request():
    # run 1: 10 s from t=100, 2 requests of 3 tokens; run 2: 5 s from t=500, 1 request of 5 tokens
    a = RunRecord(100.0, 110.0, [_req(101.0, [(101.5, 1), (101.7, 2)]), _req(105.0, [(105.1, 3)])],
                  [TaskRecord(0, 0, 100.5, 108.0)])
    b = RunRecord(500.0, 505.0, [_req(501.0, [(501.2, 1), (501.6, 4)])], [TaskRecord(0, 0, 500.0, None)])
    p = pool([a, b])
    assert (p.start, p.end) == (100.0, 115.0)
    # run 2 shifted by 110 - 500 = -390: its request was sent at 111.0, its chunks at 111.2 and 111.6
    assert p.requests[2].sent == pytest.approx(111.0)
    assert [t for t, _ in p.requests[2].chunks] == pytest.approx([111.2, 111.6])
    assert p.tasks[1].start == pytest.approx(110.0) and p.tasks[1].end is None
    f = aggregate(p, SLO())
    # 3 + 3 + 5 tokens over 10 + 5 s
    assert f["throughput_tok_s"] == pytest.approx(11 / 15)
    assert f["requests"] == 3 and f["ttft"]["p50"] == pytest.approx(200.0)  # TTFTs 0.5, 0.1, 0.2 s
    assert a.requests[0].sent == 101.0  # the inputs are left as they were
    with pytest.raises(ValueError):
        pool([])
