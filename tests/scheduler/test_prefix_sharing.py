"""N agents with one system prompt hold its blocks once; hits are exact."""

from __future__ import annotations

import random

import pytest
from simulation.sim import AgentSpec, Sim, SimTurn

BS = 16
N = 8
SYSTEM = [random.Random(7).randrange(10, 30000) for _ in range(1000)]  # 62 full blocks + 8 tokens
SHARED = len(SYSTEM) // BS


def prefix_blocks(sim: Sim) -> list[list[int]]:
    return [r.block_table[:SHARED] for r in sim.sched.q.holders() if len(r.block_table) >= SHARED]


@pytest.mark.parametrize("policy", ["agentserve", "fcfs", "chunked", "llamacpp", "no-partition"])
def test_simultaneous_agents_share_one_copy_of_the_system_prompt(policy):
    seen = {"max_holders": 0, "distinct": set()}

    def probe(sim: Sim) -> None:
        tables = prefix_blocks(sim)
        seen["max_holders"] = max(seen["max_holders"], len(tables))
        for table in tables:
            seen["distinct"].add(tuple(table))
        if len(tables) == N:
            own = sum(len(r.block_table) - SHARED for r in sim.sched.q.holders())
            assert sim.sched.kv.pool.num_used() == SHARED + own

    agents = [AgentSpec(0.0, [SimTurn(200, 20, 0.5), SimTurn(80, 20)], system=SYSTEM, seed=i) for i in range(N)]
    report = Sim(policy, agents, check_every=1, probe=probe).run()
    assert seen["max_holders"] == N, "all agents must hold the prefix at the same time at some point"
    assert len(seen["distinct"]) == 1, "the system prompt's blocks exist once"
    assert report.stats["prefix_hit_rate"] > 0.5


def test_late_agent_hits_the_cached_prompt_after_everyone_left():
    early = [AgentSpec(0.0, [SimTurn(100, 5)], system=SYSTEM, seed=i) for i in range(2)]
    late = AgentSpec(5.0, [SimTurn(100, 5)], system=SYSTEM, seed=5)
    sim = Sim("agentserve", [*early, late], check_every=1)
    sim.run()
    late_req_hits = sim.sched.kv.hit_tokens
    assert late_req_hits >= 2 * SHARED * BS, "the second and the late agent both hit the whole prompt"


def test_different_prompts_share_nothing():
    other = [random.Random(8).randrange(10, 30000) for _ in range(1000)]
    agents = [AgentSpec(0.0, [SimTurn(50, 5)], system=prompt, seed=i) for i, prompt in enumerate((SYSTEM, other), 1)]
    sim = Sim("chunked", agents, check_every=1)
    sim.run()
    assert sim.sched.kv.hit_tokens == 0
