"""The partition ladder as the scheduler sees it: rungs ordered by the decode lane's share.

The executor reports its ladder in ``Ready``.  Single-lane policies run on the *full* rung (the
largest unpartitioned one: the whole device).  The TPOT controller moves the decode reserve
``R_min`` along the *control* rungs: partitioned rungs that leave the prefill lane some units,
within the configured share bounds, ordered by decode share, and — when the upper bound is 1.0 —
the full rung on top: the 100 % slot, where decode has first claim on the whole device and the
prefill lane runs beside it at low priority (a low-priority stream; on a CPU, where the prefill lane
borrows decode's idle cores instead, the policy keeps decode off the full rung).  A ladder without split
rungs (no partitioning backend) gives a single control rung, the full one: the rung action is then a no-op.

Whether decode may take the full rung beside a running prefill is a setting (``always | never | auto``,
read by :func:`~agentserve.orchestrator.scheduler.config.allowed_here`): ``auto`` allows it on SMs only.
On CPU cores decode, whose short steps run on one thread, gains nothing there, while a prefill beside it
either competed at idle priority, behind every runnable thread of the machine, or now spreads onto decode's
threads (docs/scheduler.md).
"""

from __future__ import annotations

from agentserve.protocol.lanes import Rung


class Ladder:
    def __init__(self, rungs: list[Rung], lo_share: float = 0.0, hi_share: float = 1.0, unit: str = "SMs",
                 full_on_top: bool = True) -> None:
        """``full_on_top``: with ``hi_share`` 1.0, the full rung tops the control rungs."""
        if not rungs:
            raise ValueError("the executor reported an empty ladder")
        self.rungs = {r.index: r for r in rungs}
        self.unit = unit  # what the rungs count: SMs (a GPU) or cores (a CPU)
        # an unpartitioned rung lends the whole device to both lanes (prefill_units == decode_units)
        self.total = max(r.decode_units + r.prefill_units if r.partitioned else r.decode_units for r in rungs)
        unpartitioned = [r for r in rungs if not r.partitioned] or rungs
        self.full = max(unpartitioned, key=lambda r: (r.decode_units, -r.index)).index
        split = sorted(
            (r for r in rungs if r.partitioned and r.prefill_units > 0 and r.decode_units > 0),
            key=lambda r: (r.decode_units, r.index),
        )
        # no split rung within the bounds: all of them (bounds narrower than the ladder's steps)
        control = [r for r in split if lo_share - 1e-9 <= self.share(r.index) <= hi_share + 1e-9] or split
        if hi_share >= 1.0 - 1e-9 and full_on_top:
            control.append(self.rungs[self.full])
        self.control = [r.index for r in control] or [self.full]

    @property
    def partitioned(self) -> bool:
        return self.control != [self.full]

    def share(self, index: int) -> float:
        """The decode lane's share of the device on rung ``index``."""
        return self.rungs[index].decode_units / self.total

    def nearest(self, share: float) -> int:
        """Position in ``control`` of the rung whose decode share is nearest ``share``."""
        return min(range(len(self.control)), key=lambda i: abs(self.share(self.control[i]) - share))

    def highest_below(self, share: float) -> int:
        """Position in ``control`` of the largest decode share not above ``share`` (at least 0)."""
        best = 0
        for i, index in enumerate(self.control):
            if self.share(index) <= share + 1e-9:
                best = i
        return best
