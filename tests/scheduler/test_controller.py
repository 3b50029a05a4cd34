"""TPOT controller: settles after a load step, never oscillates, stays in bounds."""

from __future__ import annotations

import dataclasses

from simulation.fake_executor import ladder
from simulation.sim import AgentSpec, Sim, SimTurn

from agentserve.orchestrator.policies.controller import Action, TpotController
from agentserve.orchestrator.scheduler.config import SchedulerConfig
from agentserve.orchestrator.scheduler.rungs import Ladder
from agentserve.orchestrator.scheduler.window import Window

CFG = SchedulerConfig()
TARGET = CFG.slo.tpot_target_ms / 1000.0


def make(cfg: SchedulerConfig = CFG) -> TpotController:
    lad = Ladder(ladder(10), cfg.controller.r_min_lo_share, cfg.controller.r_min_hi_share)
    return TpotController(cfg.controller, cfg.slo, lad)


def drive(ctl: TpotController, plant, periods: int, load_at) -> list[tuple[Action, int, int, float]]:
    """Feed the plant's TPOT for the controller's current setting, one period at a time."""
    window = Window(CFG.controller.window_s)
    trace = []
    for k in range(periods):
        now = k * CFG.controller.period_s
        tpot = plant(ctl.b_prefill, ctl.ladder.share(ctl.rung), load_at(k))
        for i in range(CFG.controller.min_samples * 2):
            window.add(now - i * 1e-4, tpot)
        action = ctl.step(window, now)
        trace.append((action, ctl.b_prefill, ctl.rung, tpot))
    return trace


def smooth_plant(b: int, share: float, load: float) -> float:
    """TPOT grows with the resume budget and falls with the decode share (steps within the band)."""
    return load * (0.004 + 0.00002 * b) / share**0.5


def reversals(actions: list[Action]) -> int:
    moves = [a for a in actions if a is not Action.HOLD]
    return sum(1 for x, y in zip(moves, moves[1:], strict=False) if x is not y)


def assert_in_bounds(ctl: TpotController, trace) -> None:
    c = CFG.controller
    for _, b, rung, _ in trace:
        assert c.b_prefill_min <= b <= c.b_prefill_max
        assert rung in ctl.ladder.control
        assert c.r_min_lo_share - 1e-9 <= ctl.ladder.share(rung) <= c.r_min_hi_share + 1e-9


def test_settles_after_a_load_step_without_oscillating():
    ctl = make()
    step_at, periods = 40, 160
    trace = drive(ctl, smooth_plant, periods, lambda k: 1.0 if k < step_at else 3.0)
    assert_in_bounds(ctl, trace)
    actions = [a for a, *_ in trace]
    assert Action.TIGHTEN in actions[step_at:], "the load step must be noticed"
    last_change = max(k for k, a in enumerate(actions) if a is not Action.HOLD)
    c = CFG.controller
    additive = (c.b_prefill_max - c.b_prefill_min) // c.b_prefill_add
    bound = (1 + c.cooldown_periods) * (8 + len(ctl.ladder.control) + additive)
    assert last_change - step_at <= bound, f"settled only after {last_change - step_at} periods"
    assert last_change < periods - 40, "must be at a fixed point for the last 40 periods"
    final = trace[-1][3] / TARGET
    assert CFG.slo.theta_low <= final <= CFG.slo.theta_high, f"settled outside the band: {final:.2f}"
    assert reversals(actions[step_at:]) <= 2, "at most one overshoot per load change"


def test_relaxes_when_load_drops():
    ctl = make()
    trace = drive(ctl, smooth_plant, 200, lambda k: 3.0 if k < 40 else 0.5)
    assert_in_bounds(ctl, trace)
    assert trace[-1][1] > trace[39][1], "B_prefill grows back when TPOT is low"
    assert ctl.ladder.share(trace[-1][2]) < ctl.ladder.share(trace[39][2]), "R_min falls when TPOT is low"


def test_probe_hold_bounds_flapping_when_one_step_crosses_the_band():
    def cliff(b: int, share: float, load: float) -> float:
        return TARGET * (0.5 if share >= 0.55 else 1.2)  # one rung jumps across the whole band

    ctl = make()
    periods = 200
    trace = drive(ctl, cliff, periods, lambda k: 1.0)
    assert_in_bounds(ctl, trace)
    actions = [a for a, *_ in trace]
    probes = sum(1 for a, b in zip(actions, actions[1:], strict=False) if a is Action.RELAX and b is not a)
    violations = sum(1 for *_, t in trace if t > TARGET)
    assert reversals(actions) <= 2 * 6, "failed probes are retried at doubling intervals, not every period"
    assert violations <= (2 + CFG.controller.cooldown_periods) * 6, f"{violations} periods above target"
    assert probes >= 2, "the controller still probes now and then"


def test_no_feedback_never_moves():
    cfg = CFG
    lad = Ladder(ladder(10), cfg.controller.r_min_lo_share, cfg.controller.r_min_hi_share)
    ctl = TpotController(cfg.controller, cfg.slo, lad, enabled=False)
    window = Window(1.0)
    for i in range(100):
        window.add(i * 0.01, 10.0)
        assert ctl.tick(window, i * 0.1) is Action.HOLD
    assert ctl.b_prefill == cfg.controller.b_prefill_init


def test_controller_in_the_loop_keeps_budget_and_rung_in_bounds():
    slo = dataclasses.replace(CFG.slo, tpot_target_ms=25.0)
    cfg = dataclasses.replace(CFG, slo=slo)
    light = [AgentSpec(0.0, [SimTurn(150, 60, 0.3)] * 4, seed=i) for i in range(2)]
    heavy_loop = [SimTurn(200, 60, 0.2)] + [SimTurn(400, 40, 0.1)] * 5
    heavy = [AgentSpec(2.0 + 0.05 * i, heavy_loop, seed=10 + i) for i in range(10)]
    report = Sim("agentserve", light + heavy, config=cfg, check_every=4).run()
    c = cfg.controller
    lad = Ladder(ladder(10), c.r_min_lo_share, c.r_min_hi_share)
    decode_steps = [s for s in report.steps if s.lane.name == "DECODE"]
    assert all(c.b_prefill_min <= s.b_prefill <= c.b_prefill_max for s in decode_steps)
    assert all(s.rung in lad.control or s.rung == lad.full for s in decode_steps)
    assert report.stats["control_changes"] > 0, "the load step must move the controller"
