"""The sweep's bookkeeping: which server starts when, with which agent count and seed; failures; repeats."""

from __future__ import annotations

import pytest
from bench_fakes import FakeLaunches, fake_run, tiny_workload

from agentserve.bench import sweep
from agentserve.bench.progress import duration_text, time_left

SPEC = tiny_workload().spec  # seed 3


def test_agent_counts_parse_in_order_and_reject_nonsense():
    assert sweep.parse_agent_counts("1,2,3,4,5,6") == [1, 2, 3, 4, 5, 6]
    assert sweep.parse_agent_counts(" 4 , 2,") == [4, 2]
    assert sweep.parse_agent_counts("3") == [3]
    for bad in ("0", "1,x", "2,2", "", "-1", "1.5"):
        with pytest.raises(ValueError):
            sweep.parse_agent_counts(bad)


def test_plan_interleaves_systems_within_each_count_and_seeds_each_repeat():
    slots = sweep.plan([1, 3], ["agentserve", "fcfs"], repeats=2, seed=7)
    assert [(s.agents, s.repeat, s.system, s.seed) for s in slots] == [
        (1, 0, "agentserve", 7), (1, 0, "fcfs", 7), (1, 1, "fcfs", 8), (1, 1, "agentserve", 8),
        (3, 0, "agentserve", 7), (3, 0, "fcfs", 7), (3, 1, "fcfs", 8), (3, 1, "agentserve", 8),
    ]
    assert [s.index for s in slots] == list(range(8))
    three = sweep.plan([2], ["a", "b", "c"], repeats=4, seed=0)
    assert "".join(s.system for s in three) == "abc" "bca" "cab" "abc"  # each system first in turn
    with pytest.raises(ValueError):
        sweep.plan([1], [], 1, 0)
    with pytest.raises(ValueError):
        sweep.plan([1], ["a"], 0, 0)


def _drive(seen):
    def drive(target, spec, slot):
        seen.append((target, spec.agents, spec.seed, slot.index))
        return fake_run([0.1], [0.01], elapsed=1.0 + slot.index)  # tells the runs apart
    return drive


def test_every_run_gets_a_fresh_server_with_its_points_agent_count_and_seed():
    launches, seen, events = FakeLaunches(), [], []
    slots = sweep.plan([2, 4], ["agentserve", "fcfs"], repeats=2, seed=SPEC.seed)
    out = sweep.execute(slots, SPEC, launches, _drive(seen), lambda e, s, err: events.append((e, s.index)))
    starts = [e for e in launches.log if e[0] == "start"]
    assert len(starts) == 8 and len([e for e in launches.log if e[0] == "stop"]) == 8
    # each server stops before the next starts (FakeLaunches asserts it), in the planned order
    assert launches.log[:4] == [("start", "agentserve", 2, 3), ("stop", "agentserve", 2, 3),
                                ("start", "fcfs", 2, 3), ("stop", "fcfs", 2, 3)]
    assert [(s[1], s[2], s[3]) for s in starts] == [(s.system, s.agents, s.seed) for s in slots]
    assert [(t, n, seed) for t, n, seed, _ in seen] == [(s.system, s.agents, s.seed) for s in slots]
    assert events == [(kind, i) for i in range(8) for kind in ("start", "ran")]
    # one run per repeat, in repeat order
    assert [r.elapsed for r in out.at(4)["fcfs"]] == [1.0 + 5, 1.0 + 6]  # repeat 1 runs fcfs first
    assert out.failed == {} and set(out.runs) == {2, 4}


def test_a_system_that_fails_is_skipped_for_the_rest_of_that_count_and_tried_at_the_next():
    launches, seen, events = FakeLaunches(fail={("fcfs", 2): 1}), [], []
    slots = sweep.plan([2, 4], ["agentserve", "fcfs"], repeats=2, seed=0)
    out = sweep.execute(slots, SPEC, launches, _drive(seen), lambda e, s, err: events.append((e, s.system, s.agents)))
    assert out.failed == {2: ["fcfs"]}
    assert "fcfs" not in out.at(2) and len(out.at(2)["agentserve"]) == 2
    assert len(out.at(4)["fcfs"]) == 2  # tried again at 4 agents, and it ran
    assert ("failed", "fcfs", 2) in events and ("skipped", "fcfs", 2) in events
    assert [e for e in launches.log if e[1] == "fcfs" and e[2] == 2] == [("refused", "fcfs", 2, 0)]


def test_a_failure_in_a_later_repeat_drops_that_systems_earlier_runs_at_that_count():
    seen = []

    def drive(target, spec, slot):
        if target == "fcfs" and slot.repeat == 1:
            raise ConnectionError("server died mid-run")
        return _drive(seen)(target, spec, slot)

    errors = []
    out = sweep.execute(sweep.plan([3], ["agentserve", "fcfs"], 2, 0), SPEC, FakeLaunches(), drive,
                        lambda e, s, err: errors.append(err) if e == "failed" else None)
    assert list(out.at(3)) == ["agentserve"] and out.failed == {3: ["fcfs"]}
    assert isinstance(errors[0], ConnectionError)  # the exception reaches the display


def test_time_left_extrapolates_the_pace_so_far():
    assert time_left(0.0, 0.0, 100.0) is None
    # 30 s of wall time for 20 of 100 measured seconds: 80 more at that pace take 120 s
    assert time_left(30.0, 20.0, 100.0) == pytest.approx(120.0)
    assert time_left(50.0, 100.0, 100.0) == 0.0
    assert duration_text(3725) == "1:02:05" and duration_text(65) == "1:05" and duration_text(None) == "–"
