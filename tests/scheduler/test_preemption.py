"""KV exhaustion: preemption by recompute, recovery, every request finishes with all its tokens."""

from __future__ import annotations

import pytest
from simulation.sim import AgentSpec, Sim, SimTurn

from agentserve.orchestrator.policies import POLICY_NAMES


def tight_run(policy: str, num_blocks: int = 120):
    agents = [AgentSpec(0.01 * i, [SimTurn(100, 300, 0.2), SimTurn(50, 300)], seed=i) for i in range(8)]
    sim = Sim(policy, agents, num_blocks=num_blocks, block_size=16, check_every=1)
    return sim, sim.run()


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_exhaustion_preempts_and_everything_finishes(policy):
    sim, report = tight_run(policy)
    assert report.stats["preemptions"] > 0, "120 blocks cannot hold 8 x 750 tokens: must preempt"
    assert report.turns_done == report.turns_expected == 16
    for seq in report.submits:
        produced = 1 + len(report.itl.get(seq, []))
        assert produced == 300, f"seq {seq} produced {produced} tokens, not max_tokens"
    kv = report.stats["kv"]
    assert kv["used"] == 0 and report.stats["sessions"] == 0
    sim.sched.kv.pool.check({})


def test_preempted_requests_recompute_their_generated_tokens():
    sim, report = tight_run("chunked")
    assert report.stats["preemptions"] > 0
    assert report.stats["finished"] == 16 and report.stats["aborted"] == 0


def test_pins_never_deadlock_a_new_request():
    """Sessions pinned for a long tool call hold most blocks; a new agent must still run."""
    pinned = [AgentSpec(0.0, [SimTurn(600, 10, 30.0), SimTurn(10, 5)], seed=i) for i in range(3)]
    newcomer = AgentSpec(1.0, [SimTurn(1500, 20)], seed=9)
    sim = Sim("agentserve", [*pinned, newcomer], num_blocks=140, block_size=16, check_every=1)
    report = sim.run()
    assert report.turns_done == report.turns_expected
    assert report.stats["pins_broken"] > 0
    newcomer_seq = next(s for s, t in report.submits.items() if t == 1.0)
    assert report.ttft[newcomer_seq] < 1.0, "the newcomer must not wait for the pins to expire"
