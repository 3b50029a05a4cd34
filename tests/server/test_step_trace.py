"""``--trace-steps``: one JSON line per landed step, describing the plan it answered."""

from __future__ import annotations

import json

import pytest
from server_harness import serving

from agentserve.client import AgentClient
from agentserve.orchestrator.step_trace import StepTrace


def test_each_landed_step_is_one_line_describing_its_plan(tmp_path) -> None:
    path = tmp_path / "steps.jsonl"
    with (serving(tmp_path, trace=StepTrace(path)) as (endpoint, link, _server), AgentClient(endpoint) as client,
          client.session(system="sys") as s):
        s.turn("hello there", max_tokens=5, ignore_eos=True).collect()
        prompt = s.turn("again", max_tokens=3, ignore_eos=True).collect().usage.prompt_tokens
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["lane"]) for r in lines] == [(p.step, p.lane.name.lower()) for p in link.plans]
    for rec, plan in zip(lines, link.plans, strict=True):
        fed = [len(sp.token_ids) or 1 for sp in plan.seqs]
        assert rec["seqs"] == len(plan.seqs)
        assert rec["decode_seqs"] + (1 if rec["prefill_tokens"] else 0) == len(plan.seqs)
        assert rec["prefill_tokens"] + rec["decode_seqs"] == sum(fed)
        assert rec["end"] >= rec["start"] >= rec["planned"] and "policy" in rec["policy"]
        assert sum(p["tokens"] for p in rec["prefills"]) == rec["prefill_tokens"]
        assert all(p["arrival"] <= rec["planned"] for p in rec["prefills"])
    assert sum(r["decode_seqs"] for r in lines) == 5 - 1 + 3 - 1  # every token but each turn's first
    assert lines[-1]["prefill_tokens"] == 0 and any(r["prefill_tokens"] >= prompt // 2 for r in lines)
    firsts = [p for r in lines for p in r["prefills"] if p["samples"]]
    assert len(firsts) == 2 and firsts[0]["seq"] != firsts[1]["seq"]  # each turn's first token
    assert firsts[1]["phase"] == "resume" and firsts[0]["phase"] in ("cold", "resume")  # short: class by threshold


def test_an_unwritable_trace_path_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="cannot write the step trace"):
        StepTrace(tmp_path / "no" / "such" / "dir" / "steps.jsonl")


def _summary_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "scripts" / "step_trace_summary.py"
    spec = importlib.util.spec_from_file_location("step_trace_summary", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("content, says", [
    (None, "No such file"), (b"\xff\xfe", "codec can't decode"), (b'{"lane": "decode"}\n{broken\n[]\n', ":2: not JSON"),
    (b"[1, 2]\n", ":1: not a step record"), (b'{"x": 1}\n', "is not a step trace of this version"),
])
def test_the_summary_of_a_bad_trace_is_one_line_and_exit_2(tmp_path, content, says) -> None:
    import subprocess
    import sys
    from pathlib import Path

    trace = tmp_path / "t.jsonl"
    if content is not None:
        trace.write_bytes(content)
    script = Path(__file__).parents[2] / "scripts" / "step_trace_summary.py"
    res = subprocess.run([sys.executable, str(script), str(trace)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and says in res.stderr and len(res.stderr.splitlines()) == 1, res.stderr


def test_a_trace_cut_mid_line_is_read_up_to_its_last_whole_line(tmp_path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"lane": "decode"}\n{"lane": "pre')
    assert _summary_module().read_trace(str(trace)) == [{"lane": "decode"}]


def test_summary_groups_decode_steps_by_what_ran_beside_them() -> None:
    def step(lane, start, ms, decode=0, prefill=0, rung=1):
        return {"lane": lane, "rung": rung, "start": start, "end": start + ms / 1e3, "ms": ms,
                "gap_ms": 0.5, "decode_seqs": decode, "prefill_tokens": prefill}

    steps = [
        step("decode", 0.0, 40, decode=4), step("decode", 0.05, 42, decode=4),  # alone
        step("prefill", 0.10, 500, prefill=512),  # a cold chunk ...
        step("decode", 0.11, 60, decode=3), step("decode", 0.18, 140, decode=3, prefill=16),  # ... beside these
        step("prefill", 1.0, 80, prefill=56), step("decode", 1.01, 30, decode=2),  # a resume beside
    ]
    rows = _summary_module().summarise(steps)
    table = {tuple(r.split()[:-4]): r.split()[-4:] for r in rows[1:] if r.split()[0].isdigit()}
    assert table[("1", "4", "-", "none")] == ["2", "41.0", "41.8", "42.0"]  # p90 interpolated, as bench
    assert table[("1", "3", "-", "long")][:2] == ["1", "60.0"]
    assert table[("1", "3", "+prefill", "long")][:2] == ["1", "140.0"]
    assert table[("1", "2", "-", "short")][:2] == ["1", "30.0"]
    assert any("long steps: 1, median 500 ms" in r for r in rows)


def test_summary_sees_a_chunk_around_a_preempting_step_that_ended_earlier() -> None:
    def step(lane, start, ms, decode=0, prefill=0):
        return {"lane": lane, "rung": 0, "start": start, "end": start + ms / 1e3, "ms": ms,
                "gap_ms": 0.5, "decode_seqs": decode, "prefill_tokens": prefill}

    steps = [step("prefill", 0.0, 400, prefill=256), step("prefill", 0.05, 50, prefill=56),  # a resume inside
             step("decode", 0.2, 10, decode=1)]  # after the resume ended, while the chunk still runs
    rows = _summary_module().summarise(steps)
    assert any(r.split()[:4] == ["0", "1", "-", "long"] for r in rows[1:])


def test_summary_splits_each_first_token_into_queue_dispatch_and_run() -> None:
    def step(lane, planned, start, ms, prefills=()):
        tokens = sum(p["tokens"] for p in prefills)
        return {"lane": lane, "rung": 0, "planned": planned, "start": start, "end": start + ms / 1e3, "ms": ms,
                "gap_ms": 0.5, "decode_seqs": 0, "prefill_tokens": tokens, "prefills": list(prefills)}

    def entry(phase, arrival, samples=True):
        return {"seq": 1, "phase": phase, "tokens": 64, "arrival": arrival, "samples": samples}

    steps = [
        step("prefill", 0.010, 0.012, 400, [entry("cold", 0.0, samples=False)]),  # a first chunk: no token
        step("prefill", 0.100, 0.110, 30, [entry("resume", 0.090)]),  # inside the chunk
        step("prefill", 0.500, 0.501, 300, [entry("cold", 0.0)]),  # the last chunk
        step("prefill", 1.000, 1.004, 20, [entry("resume", 0.995)]),
        step("prefill", 1.100, 1.108, 40, [entry("resume", 1.090)]),
    ]
    rows = _summary_module().first_tokens(steps)
    table = {tuple(r.split()[:4]): r.split()[4:] for r in rows[1:]}
    assert table[("resume", "prefill", "inside", "1")] == ["10.0/", "10.0", "10.0/", "10.0", "30.0/", "30.0",
                                                           "50.0/", "50.0"]
    assert table[("cold", "prefill", "-", "1")][-2:] == ["801.0/", "801.0"]  # TTFT: to the last chunk's end
    queued, to_start, run, ttft = (float(table[("resume", "prefill", "-", "2")][k].rstrip("/")) for k in (0, 2, 4, 6))
    assert (queued, to_start, run, ttft) == pytest.approx((7.5, 6.0, 30.0, 43.5))  # medians of two


def test_a_failing_trace_write_stops_the_trace_not_the_server(caplog) -> None:
    from agentserve.protocol.lanes import Lane
    from agentserve.protocol.ring_messages import Result

    trace = StepTrace("/dev/full")  # every write fails with ENOSPC
    result = Result(1, Lane.DECODE, 0, [], 1.0, 1.01)
    trace.record(result, [], 0.99, {"policy": "x"})
    trace.record(result, [], 0.99, {"policy": "x"})  # silently off now
    trace.close()
    assert [r.getMessage() for r in caplog.records].count("step trace /dev/full stopped: [Errno 28] No space "
                                                         "left on device") == 1
