"""Starvation guard: a cold prefill waits at most ``starvation_s`` (plus one step) between services."""

from __future__ import annotations

import dataclasses

import pytest
from simulation.sim import AgentSpec, Sim, SimTurn

from agentserve.orchestrator.scheduler.config import SchedulerConfig

GUARD_S = 0.3
COLD_AT = 0.5


def run(policy: str, starvation_s: float):
    base = SchedulerConfig()
    cfg = dataclasses.replace(base, guard=dataclasses.replace(base.guard, starvation_s=starvation_s))
    loop = [SimTurn(200, 4, 0.001)] + [SimTurn(250, 3, 0.001)] * 14
    resumers = [AgentSpec(0.01 * i, loop, seed=i) for i in range(24)]
    cold = AgentSpec(COLD_AT, [SimTurn(2000, 4)], seed=99)
    report = Sim(policy, [*resumers, cold], config=cfg, check_every=7).run()
    seq = next(s for s, t in report.submits.items() if t == COLD_AT)
    chunks = [sv for sv in report.services[seq] if sv[1] <= report.submits[seq] + report.ttft[seq]]
    waits = [chunks[0][0] - COLD_AT] + [b[0] - a[1] for a, b in zip(chunks, chunks[1:], strict=False)]
    max_step = max(s.t1 - s.t0 for s in report.steps)
    return waits, max_step


@pytest.mark.parametrize("policy", ["no-partition", "agentserve", "no-feedback"])
def test_cold_prefill_is_served_within_the_guard(policy):
    waits, max_step = run(policy, GUARD_S)
    assert max(waits) <= GUARD_S + max_step, f"a cold prefill waited {max(waits):.3f}s"


def test_without_the_guard_resumes_starve_the_cold_prefill():
    waits, max_step = run("no-partition", 1e9)
    assert waits[0] > 5 * (GUARD_S + max_step), "the scenario must really starve an unguarded cold prefill"
