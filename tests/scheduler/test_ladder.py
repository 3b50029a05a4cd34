"""The scheduler's view of the executor's ladder, for the ladder shapes the executor builds."""

from __future__ import annotations

from agentserve.executor.partition.ladder import CPU_GRANULARITY, build_ladder
from agentserve.orchestrator.policies import make_policy
from agentserve.orchestrator.scheduler.config import SchedulerConfig
from agentserve.orchestrator.scheduler.rungs import Ladder
from agentserve.protocol.lanes import Rung

CC = SchedulerConfig().controller


def test_gpu_like_ladder_controls_partitioned_rungs_in_bounds():
    rungs = [Rung(i, d, 64 - d, True) for i, d in enumerate(range(8, 64, 8))] + [Rung(7, 64, 64, False)]
    lad = Ladder(rungs, CC.r_min_lo_share, CC.r_min_hi_share)
    assert lad.total == 64 and lad.full == 7 and lad.partitioned
    # the split rungs within [lo, hi], then (hi = 1.0) the full rung: decode first on the whole device
    assert [lad.share(i) for i in lad.control] == [0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0]
    assert lad.control[-1] == lad.full
    capped = Ladder(rungs, CC.r_min_lo_share, 0.9)
    assert [capped.share(i) for i in capped.control] == [0.25, 0.375, 0.5, 0.625, 0.75, 0.875]
    assert lad.share(lad.control[lad.nearest(0.5)]) == 0.5
    assert lad.share(lad.control[lad.highest_below(0.7)]) == 0.625
    # bounds no split rung falls within: every split rung stays controllable, the full rung still on top
    narrow = Ladder(rungs, 0.95, 1.0)
    assert [narrow.share(i) for i in narrow.control] == [0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0]


def test_two_core_cpu_ladder_from_the_executor():
    rungs = build_ladder(2, CPU_GRANULARITY)
    lad = Ladder(rungs, CC.r_min_lo_share, CC.r_min_hi_share)
    assert lad.total == 2
    assert lad.rungs[lad.full].partitioned is False
    split = [r.index for r in rungs if r.partitioned]
    assert split == [0], "1+1 cores is the only split"
    assert lad.control == [*split, lad.full]
    policy = make_policy("agentserve", SchedulerConfig(), lad)
    assert policy.ctl.rung in lad.control
    own_cores = Ladder(rungs, CC.r_min_lo_share, CC.r_min_hi_share, "cores", full_on_top=False)
    assert own_cores.control == split and own_cores.partitioned, "the controller's reserve stays on 1+1 cores"


def test_unpartitioned_backend_gives_a_single_rung_and_a_no_op_rung_action():
    lad = Ladder([Rung(0, 132, 132, False)], CC.r_min_lo_share, CC.r_min_hi_share)
    assert lad.control == [0] and lad.full == 0 and not lad.partitioned
    assert lad.share(0) == 1.0
