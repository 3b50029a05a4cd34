"""TPOT feedback controller: steers the resume budget ``B_prefill`` and the decode reserve ``R_min``.

Every control period ``P`` the controller reads the windowed TPOT statistic ``T`` (the configured
quantile of per-token inter-token times over the last ``window_s`` seconds) and compares it with the
target ``T*``:

- ``T > θ_high·T*`` (tighten): ``B ← max(B_min, ⌊β·B⌋)`` and ``R_min`` rises one rung (≤ the top);
- ``T < θ_low·T*``  (relax):   ``B ← min(B_cap, B + α)`` and ``R_min`` falls one rung (≥ the floor);
- otherwise (the dead band), or with fewer than ``min_samples`` samples: hold.

After a change the window is cleared and ``cooldown_periods`` periods are skipped, so the next
decision sees only samples taken under the new setting.  If a tighten immediately undoes a relax
(the relax crossed the whole band), that relax is marked as a bad probe: for ``probe_hold_periods``
periods — doubled on each consecutive bad probe, reset by any other tighten — ``B`` may not grow
past the value just below it and ``R_min`` may not fall below the rung it returns to.

Why it cannot oscillate. Assume TPOT rises with ``B`` and falls with ``R_min`` (more decode units)
under a fixed load. (1) One period changes ``R_min`` by one rung and ``B`` by at most ``α`` upward,
so relaxing moves TPOT by a bounded step; (2) the dead band ``[θ_low, θ_high]`` absorbs any step
smaller than its width, so a relax from below the band lands below or inside it, never above — the
only move that can flip the sign is a tighten overshooting below ``θ_low``, after which additive
relax steps climb back and stop inside the band: at most one sign change per load change, and the
state is a fixed point once ``T`` is in the band. (3) Where a single rung or ``α`` step is wider
than the band (the assumption fails), the probe hold forbids retrying that step for
``probe_hold_periods`` (doubling), so instead of a two-period limit cycle the controller re-probes
at exponentially growing intervals: O(log n) violations in n periods. (4) The cooldown removes
controller lag from the loop: a decision is never based on samples taken before the previous change.
Bounds: ``B ∈ [B_min, B_max]`` and ``R_min`` within the control rungs at all times. After a load
step the controller settles within ``(1 + cooldown)·(⌈log_{1/β}(B_max/B_min)⌉ + rungs + ⌈(B_max −
B_min)/α⌉)`` periods.
"""

from __future__ import annotations

import enum

from agentserve.orchestrator.scheduler.config import ControllerCfg, SloCfg
from agentserve.orchestrator.scheduler.rungs import Ladder
from agentserve.orchestrator.scheduler.window import Window


class Action(enum.IntEnum):
    HOLD = 0
    TIGHTEN = 1
    RELAX = 2


class TpotController:
    def __init__(self, cfg: ControllerCfg, slo: SloCfg, ladder: Ladder, enabled: bool = True,
                 shrink_below_init: bool = True) -> None:
        """``shrink_below_init``: tightening may take ``B`` down to ``b_prefill_min``; else not below
        ``b_prefill_init`` (the value a controller-less policy holds)."""
        self.cfg, self.slo, self.ladder, self.enabled = cfg, slo, ladder, enabled
        self.b_floor = cfg.b_prefill_min if shrink_below_init else cfg.b_prefill_init
        self.b_prefill = cfg.b_prefill_init
        self.pos = ladder.nearest(cfg.r_min_init_share)
        self.top = len(ladder.control) - 1
        self.periods = 0
        self.next_t: float | None = None
        self.cooldown = 0
        self.last_action = Action.HOLD
        self.last_change = -(10**9)
        self.hold_until = -1
        self.b_cap = cfg.b_prefill_max
        self.pos_floor = 0
        self.bad_probes = 0
        self.last_tpot: float | None = None
        self.changes = 0

    @property
    def rung(self) -> int:
        return self.ladder.control[self.pos]

    def tick(self, window: Window, now: float) -> Action:
        """Run the control law if a period has passed since the last run."""
        if not self.enabled:
            return Action.HOLD
        if self.next_t is None:
            self.next_t = now + self.cfg.period_s
            return Action.HOLD
        if now < self.next_t:
            return Action.HOLD
        self.next_t = now + self.cfg.period_s
        return self.step(window, now)

    def step(self, window: Window, now: float) -> Action:
        """One control period: read the window, decide, apply."""
        self.periods += 1
        if self.cooldown > 0:
            self.cooldown -= 1
            return Action.HOLD
        if window.count(now) < self.cfg.min_samples:
            return Action.HOLD
        tpot = window.quantile(self.slo.tpot_quantile, now)
        self.last_tpot = tpot
        ratio = tpot * 1000.0 / self.slo.tpot_target_ms  # type: ignore[operator]
        if ratio > self.slo.theta_high:
            action = self._tighten()
        elif ratio < self.slo.theta_low:
            action = self._relax()
        else:
            action = Action.HOLD
        if action is not Action.HOLD:
            window.clear()
            self.cooldown = self.cfg.cooldown_periods
            self.last_action, self.last_change = action, self.periods
            self.changes += 1
        return action

    def _tighten(self) -> Action:
        cfg = self.cfg
        just_relaxed = self.periods - self.last_change <= 1 + cfg.cooldown_periods
        undo = self.last_action is Action.RELAX and just_relaxed
        self.bad_probes = self.bad_probes + 1 if undo else 0
        if undo:
            self.hold_until = self.periods + cfg.probe_hold_periods * 2 ** min(self.bad_probes - 1, 10)
            self.b_cap = max(self.b_floor, self.b_prefill - cfg.b_prefill_add)
            self.pos_floor = min(self.pos + 1, self.top)
        b = max(self.b_floor, int(self.b_prefill * cfg.b_prefill_mult))
        pos = min(self.pos + 1, self.top)
        return self._apply(b, pos, Action.TIGHTEN)

    def _relax(self) -> Action:
        cfg = self.cfg
        held = self.periods < self.hold_until
        cap = self.b_cap if held else cfg.b_prefill_max
        floor = self.pos_floor if held else 0
        b = max(self.b_prefill, min(cap, self.b_prefill + cfg.b_prefill_add))
        pos = min(self.pos, max(floor, self.pos - 1))
        return self._apply(b, pos, Action.RELAX)

    def _apply(self, b: int, pos: int, action: Action) -> Action:
        if b == self.b_prefill and pos == self.pos:
            return Action.HOLD
        self.b_prefill, self.pos = b, pos
        return action

    def stats(self) -> dict[str, object]:
        return {
            "b_prefill": self.b_prefill,
            "r_min_rung": self.rung,
            "r_min_share": round(self.ladder.share(self.rung), 3),
            "feedback": self.enabled,
            "control_periods": self.periods,
            "control_changes": self.changes,
            "tpot_controlled_ms": None if self.last_tpot is None else self.last_tpot * 1000.0,
        }
