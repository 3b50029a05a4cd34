"""The workload generator: BRIEF §3 distributions, determinism, the shared prefix."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from agentserve.bench.workload import Span, ToolLatency, Workload, load_spec


def _turns(w: Workload, tasks: int = 60):
    return [t for a in range(w.spec.agents) for i in range(tasks) for t in w.task(a, i).turns]


@pytest.mark.parametrize(
    ("name", "resume", "decode"),
    [("react", (30, 127, 56), (37, 45, 38)), ("plan-execute", (125, 421, 251), (55, 64, 58))],
)
def test_packaged_workloads_follow_the_brief(name, resume, decode):
    w = Workload(load_spec(name))
    turns = _turns(w)
    cold = [len(t.prompt_ids) for t in turns if t.kind == "cold"]
    res = [len(t.prompt_ids) for t in turns if t.kind == "resume"]
    dec = [t.decode_tokens for t in turns]
    assert min(cold) >= 2500 and max(cold) <= 3500
    assert abs(statistics.mean(cold) - 3000) < 40
    assert min(res) >= resume[0] and max(res) <= resume[1]
    assert abs(statistics.mean(res) - resume[2]) < 0.04 * resume[2]
    assert min(dec) >= decode[0] and max(dec) <= decode[1]
    assert abs(statistics.mean(dec) - decode[2]) < 0.5
    # the ranges are really used, not collapsed onto the mean
    assert max(res) - min(res) > 0.5 * (resume[1] - resume[0])


def test_task_shape_and_vocab_range():
    spec = load_spec("react", steps_per_task=5, vocab_low=7, vocab_high=11)
    task = Workload(spec).task(2, 3)
    assert [t.kind for t in task.turns] == ["cold"] + ["resume"] * 4
    assert task.turns[0].wait_s == 0.0
    assert all(t.wait_s > 0 for t in task.turns[1:])
    ids = {i for t in task.turns for i in t.prompt_ids}
    assert ids <= set(range(7, 11)) and len(ids) == 4


def test_deterministic_per_seed_agent_and_task():
    a, b = Workload(load_spec("react")), Workload(load_spec("react"))
    assert a.task(1, 4) == b.task(1, 4)
    assert a.task(1, 4) != a.task(1, 5)
    assert a.task(1, 4) != a.task(2, 4)
    c = Workload(load_spec("react", seed=1))
    assert c.task(1, 4) != a.task(1, 4)


def test_all_agents_share_the_prefix_but_tasks_differ():
    w = Workload(load_spec("react"))
    n = w.spec.shared_prefix_tokens
    firsts = [w.task(a, i).turns[0].prompt_ids for a in range(4) for i in range(3)]
    assert all(p[:n] == w.shared_prefix for p in firsts)
    assert len({p[n:] for p in firsts}) == len(firsts)
    # a different seed changes the prefix too
    assert Workload(load_spec("react", seed=9)).shared_prefix != w.shared_prefix


def test_tool_latency_is_lognormal_with_the_configured_median():
    spec = load_spec("react", tool_latency_median_s=2.0, tool_latency_sigma=0.4)
    waits = [t.wait_s for t in _turns(Workload(spec), 80) if t.kind == "resume"]
    assert abs(statistics.median(waits) - 2.0) < 0.1
    logs = [math.log(x) for x in waits]
    assert abs(statistics.stdev(logs) - 0.4) < 0.03
    assert ToolLatency(0.0, 0.5).draw(random.Random(0)) == 0.0


def test_span_rejects_inconsistent_bounds_and_handles_degenerate_range():
    with pytest.raises(ValueError):
        Span(10, 5, 7)
    with pytest.raises(ValueError):
        Span(1, 5, 9)
    assert Span(4, 4, 4).draw(random.Random(0)) == 4


def test_file_workload_and_validation(tmp_path):
    p = tmp_path / "w.toml"
    p.write_text(
        "[workload]\nsteps_per_task = 2\nshared_prefix_tokens = 4\n"
        "cold_prefill = {min = 8, max = 8, mean = 8}\nresume_prefill = {min = 1, max = 3, mean = 2}\n"
        "decode = {min = 2, max = 2, mean = 2}\n"
    )
    task = Workload(load_spec(str(p))).task(0, 0)
    assert [len(t.prompt_ids) for t in task.turns][0] == 8 and len(task.turns) == 2
    p.write_text(p.read_text().replace("shared_prefix_tokens = 4", "shared_prefix_tokens = 8"))
    with pytest.raises(ValueError):
        load_spec(str(p))
