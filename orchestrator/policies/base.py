"""The policy interface: what one lane runs in one step.

A policy fills a :class:`~agentserve.orchestrator.scheduler.batch.Batch` for a free lane from the queues and
returns ``(token_budget, rung)`` for the Plan, or ``None`` to leave the lane idle this step.  It
never touches blocks itself: the batch asks the scheduler to admit, grow and preempt.
``other_rung`` is the rung the other lane holds: the full rung if any of its plans in flight is on it,
else that of its latest plan (``None`` when that lane is idle).
"""

from __future__ import annotations

from typing import ClassVar

from agentserve.orchestrator.scheduler.batch import Batch, Entry
from agentserve.orchestrator.scheduler.config import SchedulerConfig
from agentserve.orchestrator.scheduler.queues import Queues
from agentserve.orchestrator.scheduler.rungs import Ladder
from agentserve.orchestrator.scheduler.window import Window
from agentserve.protocol.lanes import Lane


class Policy:
    name: ClassVar[str] = ""
    lanes: ClassVar[tuple[Lane, ...]] = (Lane.DECODE,)
    retains: ClassVar[bool] = False  # pins a session's KV while its tool runs
    by_priority: ClassVar[bool] = False  # decodes ordered by request priority

    def __init__(self, config: SchedulerConfig, ladder: Ladder) -> None:
        self.config = config
        self.ladder = ladder

    @property
    def retain_on_tool_call(self) -> bool:
        return self.retains and self.config.kv.retain_on_tool_call

    def max_seqs(self, lane: Lane) -> int:
        return self.config.scheduler.max_batch_seqs

    def tick(self, tpot: Window, now: float) -> None:
        """Called once per ``schedule()``, before any lane is filled (feedback hook)."""

    def fill(self, lane: Lane, batch: Batch, q: Queues, now: float, other_rung: int | None) -> tuple[int, int] | None:
        raise NotImplementedError

    def holds_decode_cores(self, lane: Lane, batch: Batch) -> bool:
        """Whether the lane's step in ``batch`` keeps the decode lane's cores to its end (``Plan.hold_cores``, CPU
        cores); no by default."""
        return False

    def fill_preempting(self, batch: Batch, q: Queues, now: float, running: list[Entry],
                        preempted: int) -> tuple[int, int] | None:
        """A plan to run inside the prefill lane's plan in flight (``running``: its entries; ``preempted``:
        how many such plans it already ran), at its next layer boundary; ``None``: none (the default)."""
        return None

    def preempts_first(self) -> bool:
        """Whether a plan to run inside the prefill lane's plan in flight is decided before the lanes' own plans, so
        that what it takes (waiting resumes) is not planned on an idle lane first; no by default."""
        return False

    def stats(self) -> dict[str, object]:
        return {"policy": self.name, "rung": self.ladder.full}

    def decode_all(self, batch: Batch, q: Queues) -> None:
        for req in q.decode_order(self.by_priority):
            if batch.full:
                break
            batch.decode(req)
