"""The closed-loop replayer over a fake driver: turns in order, tool waits, deadline, errors."""

from __future__ import annotations

import asyncio
import time

from bench_fakes import FakeDriver, tiny_workload

from agentserve.bench.metrics import SLO, aggregate
from agentserve.bench.replayer import run_closed_loop


def test_agents_replay_their_scripts_in_a_closed_loop():
    w = tiny_workload(agents=2, steps=3, tool_s=0.01)
    driver = FakeDriver(token_s=0.001)
    seen = []
    run = asyncio.run(run_closed_loop(driver, w, duration_s=0.4, on_request=seen.append))
    assert run.elapsed >= 0.4
    for agent in range(2):
        reqs = [r for r in run.requests if r.agent == agent]
        assert len(reqs) >= 6  # at least two tasks of 3 turns each in 0.4 s
        for r in reqs:
            turn = w.task(agent, r.task).turns[r.step]
            assert (r.kind, r.prompt_tokens, r.max_tokens) == (turn.kind, len(turn.prompt_ids),
                                                                turn.decode_tokens)
            assert r.n_tokens == r.max_tokens and r.error is None
        # closed loop: a turn is sent only after the previous one's last token + the tool wait
        for a, b in zip(reqs, reqs[1:], strict=False):
            gap = b.sent - a.chunks[-1][0]
            assert gap >= w.task(agent, b.task).turns[b.step].wait_s - 1e-3
        # tasks in order, each starting with its cold turn
        assert [r.step for r in reqs[:6]] == [0, 1, 2, 0, 1, 2]
    assert len(seen) == len(run.requests)
    # sessions: one per task, opened with its first turn, every one closed
    assert driver.opened == driver.closed == len(run.tasks)
    done = [t for t in run.tasks if t.end is not None]
    assert done and all(t.end > t.start for t in done)
    # no turn is started after the deadline
    assert all(r.sent < run.start + 0.4 for r in run.requests)
    m = aggregate(run, SLO(ttft_s=10, tpot_s=10))
    assert m["slo_attainment"] == 1.0 and m["errors"] == 0


def test_a_failing_server_stops_the_agents_with_recorded_errors():
    w = tiny_workload(agents=3, steps=3)
    driver = FakeDriver(fail_after=2)
    t0 = time.perf_counter()
    run = asyncio.run(run_closed_loop(driver, w, duration_s=30.0))
    # returned long before the 30 s deadline: every agent stopped at its first error
    assert time.perf_counter() - t0 < 5.0
    assert run.elapsed >= 30.0, "its rates divide by the window asked for, not by the part that worked"
    assert sum(r.error is not None for r in run.requests) == 3
    assert all("server gone" in r.error for r in run.requests if r.error)
    assert driver.opened == driver.closed


def test_a_session_is_opened_inside_its_first_turns_timing():
    """A server that needs a session pays its open in the cold turn's TTFT, and a refused open is the turn's error."""
    w = tiny_workload(agents=1, steps=2, tool_s=0.0)
    run = asyncio.run(run_closed_loop(FakeDriver(token_s=0.001, open_s=0.05), w, duration_s=0.3))
    cold = [r for r in run.requests if r.step == 0]
    resumed = [r for r in run.requests if r.step > 0]
    assert cold and resumed
    assert all(r.ttft >= 0.05 for r in cold) and all(r.ttft < 0.05 for r in resumed)
    run = asyncio.run(run_closed_loop(FakeDriver(open_fails=True), w, duration_s=5.0))
    assert [r.error for r in run.requests] == ["ConnectionError: open refused"]


def test_a_stuck_request_times_out_instead_of_hanging():
    w = tiny_workload(agents=1, steps=2)
    driver = FakeDriver(token_s=5.0)
    run = asyncio.run(run_closed_loop(driver, w, duration_s=0.1, request_timeout_s=0.2))
    assert len(run.requests) == 1 and "TimeoutError" in run.requests[0].error


def test_a_long_tool_wait_does_not_outlast_the_run():
    w = tiny_workload(agents=2, steps=3, tool_s=30.0)
    run = asyncio.run(run_closed_loop(FakeDriver(), w, duration_s=0.3))
    assert run.elapsed < 2.0
    # only the cold turns ran; the tasks were cut off while their tools ran
    assert {r.kind for r in run.requests} == {"cold"}
    assert all(t.end is None for t in run.tasks)
