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
        assert rec["end"] >= rec["start"] and "policy" in rec["policy"]
    assert sum(r["decode_seqs"] for r in lines) == 5 - 1 + 3 - 1  # every token but each turn's first
    assert lines[-1]["prefill_tokens"] == 0 and any(r["prefill_tokens"] >= prompt // 2 for r in lines)


def test_an_unwritable_trace_path_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="cannot write the step trace"):
        StepTrace(tmp_path / "no" / "such" / "dir" / "steps.jsonl")
