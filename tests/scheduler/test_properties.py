"""Property tests over random arrivals, tool latencies, prompts, capacities and policies.

After every scheduling step: no negative refcount, every reference accounted to exactly one holder,
no block twice in one table, no block both free and in use (``Scheduler.check``); the fake executor
checks that no shared block is written and every cached prefix holds exactly the tokens expected.
At the end: every request finished with all its tokens, and all blocks are free again.
"""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from simulation.sim import AgentSpec, Sim, SimTurn

from agentserve.orchestrator.policies import POLICY_NAMES
from agentserve.orchestrator.scheduler.config import SchedulerConfig

turns = st.lists(
    st.builds(
        SimTurn,
        new_tokens=st.integers(1, 500),
        max_tokens=st.integers(1, 40),
        tool_s=st.floats(0.0, 3.0, allow_nan=False),
    ),
    min_size=1,
    max_size=4,
)


@st.composite
def workloads(draw):
    system = draw(st.sampled_from([0, 17, 200]))
    prompt = list(range(100, 100 + system))
    agents = [
        AgentSpec(
            start=draw(st.floats(0.0, 2.0, allow_nan=False)),
            turns=draw(turns),
            system=prompt if draw(st.booleans()) else [],
            priority=draw(st.integers(0, 2)),
            seed=i,
        )
        for i in range(draw(st.integers(1, 7)))
    ]
    block_size = draw(st.sampled_from([4, 16]))
    longest = max(len(a.system) + sum(t.new_tokens + t.max_tokens for t in a.turns) for a in agents) + 2
    num_blocks = -(-longest // block_size) + 1 + draw(st.integers(0, 80))
    return agents, block_size, num_blocks


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    workload=workloads(),
    policy=st.sampled_from(POLICY_NAMES),
    partitioned=st.booleans(),
    lookahead=st.integers(0, 2),
)
def test_kv_invariants_hold_and_everything_finishes(workload, policy, partitioned, lookahead):
    agents, block_size, num_blocks = workload
    base = SchedulerConfig()
    config = dataclasses.replace(base, scheduler=dataclasses.replace(base.scheduler, decode_lookahead=lookahead))
    sim = Sim(policy, agents, num_blocks=num_blocks, block_size=block_size, partitioned=partitioned, config=config)
    sim.check_every = 1
    report = sim.run()
    assert report.turns_done == report.turns_expected
    turn_of: dict[int, int] = {}
    for seq in sorted(report.submits):  # seq ids grow with submission order
        agent = sim.seq_agent[seq]
        turn = turn_of[agent] = turn_of.get(agent, -1) + 1
        produced = 1 + len(report.itl.get(seq, []))
        assert produced == agents[agent].turns[turn].max_tokens, f"seq {seq} produced {produced} tokens"
    pool = sim.sched.kv.pool
    pool.check({})
    assert pool.num_available() == pool.num_blocks, "all blocks free (or cached) at the end"
    assert not sim.sched.sessions and not sim.sched.requests and not sim.sched.ended
