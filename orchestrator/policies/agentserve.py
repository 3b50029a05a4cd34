"""AgentServe: phase-aware classes, TPOT feedback and two lanes on partition rungs.

Decode lane, every step: every decoding request first (priority order), then resume prefills —
admitted ones first, then waiting ones — up to ``B_prefill`` tokens (a mixed Plan), on rung
``R_min``.  Prefill lane, concurrently: cold prefills FIFO in chunks of ``cold_chunk_tokens`` on the
same rung's prefill partition (on the full rung while nothing decodes).

Which lane a resume takes (``prefill_lane_resumes``): with ``first`` the prefill lane serves waiting
resumes before its next cold chunk (a step of resumes only, so the lane is back soon; never two such
steps running while a cold prefill waits, so a flood of resumes cannot hold it back), and a resume
rides in a step with decodes in it only once it has waited ``resume_ride_after_ms`` since it arrived — on a CPU a
56-token resume over a 3k context costs a decode step ~6x its usual time, paid by every agent
decoding, while waiting for the prefill lane delays one cold prefill by the same amount.  With
``idle`` the prefill lane takes resumes only when no cold prefill is left, with ``never`` not at all;
both let a resume ride at once (the paper's piggybacking).
The :class:`TpotController` moves ``B_prefill`` and ``R_min``.

On CPU cores (``prefill_borrows_decode_cores``) prefill steps run on the full rung even beside a partitioned
decode lane: the executor lends them decode's cores while decode idles and takes them back at the next layer
boundary when a decode step comes (``executor/partition/core_loan.py``).  Decode then keeps to its partition
(resumes alone included); where a setting lets decode take the full rung (``always``), there is no borrowing.

Decode takes the full (unpartitioned) rung while no cold prefill exists at all, or when the controller
sets ``R_min`` to it (the 100 % slot).  A prefill step planned while decode holds or is headed for the
full rung runs on the full rung too, beside decode at low priority (decode first, prefill in what it
leaves); decode moves up to the full rung only once no prefill step holds a partition.

Starvation guard: when the next cold prefill (FIFO head) has gone ``starvation_s`` without service, the decode reserve
is capped so the prefill partition keeps ``min_prefill_share`` of the device, and no new resume
prefill is admitted (so blocks free up for the cold one) until it is served.

Ablations: ``no-feedback`` (static ``B_prefill`` and ``R_min`` from the config) and ``no-partition``
(classes and feedback on one shared lane on the full rung: decodes, then resumes, then cold chunks
within ``B_prefill``; a starving cold prefill gets ``min_tokens`` of it first).
"""

from __future__ import annotations

from collections.abc import Callable

from agentserve.orchestrator.policies.base import Policy
from agentserve.orchestrator.policies.controller import TpotController
from agentserve.orchestrator.scheduler.batch import Batch, Entry
from agentserve.orchestrator.scheduler.config import SchedulerConfig, allowed_here
from agentserve.orchestrator.scheduler.queues import Queues
from agentserve.orchestrator.scheduler.request import Phase, ReqState, Request
from agentserve.orchestrator.scheduler.rungs import Ladder
from agentserve.orchestrator.scheduler.window import Window
from agentserve.protocol.lanes import Lane


class AgentServe(Policy):
    name = "agentserve"
    lanes = (Lane.DECODE, Lane.PREFILL)
    retains = True
    by_priority = True
    feedback = True

    def __init__(self, config: SchedulerConfig, ladder: Ladder) -> None:
        super().__init__(config, ladder)
        self.ctl = TpotController(config.controller, config.slo, self.control_ladder(), self.feedback,
                                  allowed_here(config.controller.shrink_b_prefill, ladder.unit))
        self.guard_pos = ladder.highest_below(1.0 - config.guard.min_prefill_share)
        self.resumes_ran_last = False  # the prefill lane's last step was resumes only
        self.full_rung_when_idle = allowed_here(config.scheduler.decode_full_rung_when_idle, ladder.unit)
        # on CPU cores the executor lends a full-rung prefill step decode's cores only while decode idles; it
        # assumes decode keeps to its partition (a full-rung decode step would spread onto the prefill's core)
        self.borrows = (config.scheduler.prefill_borrows_decode_cores and ladder.unit == "cores"
                        and not self.full_rung_when_idle and ladder.full not in ladder.control)

    def control_ladder(self) -> Ladder:
        return self.ladder

    def tick(self, tpot: Window, now: float) -> None:
        self.ctl.tick(tpot, now)

    def starving(self, q: Queues, now: float) -> bool:
        """The next cold prefill (FIFO head) has gone ``starvation_s`` without service."""
        head = q.head(Phase.COLD)
        return head is not None and not head.inflight and now - head.queued_since > self.config.guard.starvation_s

    def _pos(self, starving: bool) -> int:
        """The controller's position on the ladder, capped by the starvation guard."""
        return min(self.ctl.pos, self.guard_pos) if starving else self.ctl.pos

    def _wanted_rung(self, q: Queues, starving: bool) -> int:
        """Decode's rung while no prefill step holds a partition: the full rung if no cold prefill exists
        (at most resumes beside it, at low priority), else the controller's rung."""
        cold = q.waiting[Phase.COLD] or q.prefilling[Phase.COLD]
        if self.full_rung_when_idle and not cold:
            return self.ladder.full
        return self.ladder.control[self._pos(starving)]

    def decode_rung(self, q: Queues, starving: bool, prefill_rung: int | None) -> int:
        """The decode lane's rung, given the rung the prefill lane holds (``None``: idle)."""
        full, control = self.ladder.full, self.ladder.control
        if prefill_rung in (None, full):
            return self._wanted_rung(q, starving)
        pos = self._pos(starving)
        # a prefill step still holds its partition at normal priority: move up to the full rung when it is back
        return control[max(0, pos - 1)] if control[pos] == full else control[pos]

    def fill(self, lane: Lane, batch: Batch, q: Queues, now: float, other_rung: int | None):
        starving = self.starving(q, now)
        if lane is Lane.DECODE:
            rung = self.decode_rung(q, starving, other_rung)
            self.decode_all(batch, q)
            alone_on_idle_device = batch.num_decode == 0 and other_rung is None
            if not (alone_on_idle_device and self.borrows and self.config.scheduler.prefill_lane_resumes == "first"):
                # (borrowing, the idle prefill lane takes them, on every core)
                decoding = batch.num_decode > 0
                self.add_prefills(batch, q, Phase.RESUME, self.ctl.b_prefill, admit_new=not starving,
                                  only=lambda req: self.rides(req, now, decoding))
            if alone_on_idle_device and not self.borrows:
                rung = self.ladder.full  # resumes alone while the prefill lane idles: every unit is free
            return batch.num_decode + self.ctl.b_prefill, rung
        return self.fill_prefill(batch, q, starving, other_rung)

    def fill_prefill(self, batch: Batch, q: Queues, starving: bool, decode_rung: int | None) -> tuple[int, int]:
        """The prefill lane's step: a cold chunk, or waiting resumes (``prefill_lane_resumes``)."""
        rung = self.prefill_rung(q, starving, decode_rung)
        sc = self.config.scheduler
        budget = sc.cold_chunk_tokens
        mode = sc.prefill_lane_resumes
        # resumes first, but never twice running while a cold prefill waits; a starving one goes first
        resumes_first = mode == "first" and not starving and not self.resumes_ran_last
        if resumes_first and self.add_prefills(batch, q, Phase.RESUME, budget):
            self.resumes_ran_last = True
            return budget, rung
        self.resumes_ran_last = False
        if not self.add_prefills(batch, q, Phase.COLD, budget, max_seqs=sc.max_prefill_seqs) and mode != "never":
            self.add_prefills(batch, q, Phase.RESUME, budget, admit_new=not starving)
        return budget, rung

    def holds_decode_cores(self, lane: Lane, batch: Batch) -> bool:
        """A borrowing prefill-lane step of resumes only, of at most ``resume_hold_max_tokens`` tokens: it runs on every
        core even while agents decode, which wait for it.  A short resume on one core beside decode took 1.7-1.9x as
        long; a long one would stall decode for as long as it runs (docs/scheduler.md has the figures)."""
        return (lane is Lane.PREFILL and bool(batch.entries) and self.holds_for(batch.num_prefill_tokens)
                and all(req.phase is Phase.RESUME for req, *_ in batch.entries))

    def holds_for(self, prefill_tokens: int) -> bool:
        """Whether a prefill-lane step of resumes of this many tokens would hold decode's cores."""
        return self.borrows and prefill_tokens <= self.config.scheduler.resume_hold_max_tokens

    def fill_preempting(self, batch: Batch, q: Queues, now: float, running: list[Entry],
                        preempted: int) -> tuple[int, int] | None:
        """Waiting resumes, to run inside the cold chunk in flight at its next layer boundary
        (``preempt_cold_chunks``, with ``first``): on a CPU a resume then waits for about one layer of the
        chunk, not all of it.  Once per chunk, and it counts as the lane's resume turn (the next prefill-lane
        step is a cold chunk), so a flood of resumes still leaves cold prefills every other turn; never while
        the next cold prefill starves."""
        sc = self.config.scheduler
        if (not sc.preempt_cold_chunks or sc.prefill_lane_resumes != "first" or preempted
                or not any(req.phase is Phase.COLD for req, *_ in running) or self.starving(q, now)):
            return None
        if not self.add_prefills(batch, q, Phase.RESUME, sc.cold_chunk_tokens):
            return None
        self.resumes_ran_last = True
        return sc.cold_chunk_tokens, self.ladder.full  # the rung is the running plan's

    def preempts_first(self) -> bool:
        """On CPU cores (borrowing), resumes enter a cold chunk in flight before the idle decode lane may take them
        (there a short resume rides only once it has waited ``resume_ride_after_ms``: :meth:`rides`): alone on decode's
        one core it would take ~2x as long as held on both (~33 against ~19 ms for react's ~60 tokens on Zen 5) and
        take that core back from the chunk, which then ran on one core as long.  Entering the chunk, it waits for the
        layer in progress and pauses the chunk for its short step."""
        sc = self.config.scheduler
        return self.borrows and sc.preempt_cold_chunks and sc.prefill_lane_resumes == "first"

    def rides(self, req: Request, now: float, decoding: bool) -> bool:
        """Whether a waiting resume may ride in this decode step rather than wait for the prefill lane: with
        ``first``, in a step that has decodes only once it has waited ``resume_ride_after_ms``; in one with none
        at once, except on CPU cores for one the prefill lane would run holding every core
        (:meth:`holds_for`) — alone on decode's one core it takes ~2x as long as after the busy lane's
        step. A longer one would only borrow there, and cold chunks would wait behind it."""
        sc = self.config.scheduler
        waits = sc.prefill_lane_resumes == "first" and (decoding or self.holds_for(req.num_uncached_at_class))
        return not waits or now - req.arrival >= sc.resume_ride_after_ms / 1e3

    def prefill_rung(self, q: Queues, starving: bool, decode_rung: int | None) -> int:
        """The prefill lane's rung, given the rung the decode lane holds (``None``: idle)."""
        full = self.ladder.full
        if decode_rung is None and not q.decoding:
            return full  # nothing to decode: the prefill takes the whole device
        headed = self._wanted_rung(q, starving)  # where decode goes while this prefill step runs
        rung = headed if decode_rung is None or headed == full else decode_rung
        return full if self.borrows and self.ladder.rungs[rung].partitioned else rung

    def add_prefills(self, batch: Batch, q: Queues, phase: Phase, budget: int, *, admit_new: bool = True,
                     only: Callable[[Request], bool] | None = None, max_seqs: int | None = None) -> int:
        """Prompt tokens of ``phase`` requests (admitted ones first) up to ``budget``; returns how many.
        ``admit_new``: waiting ones may be admitted; ``only``: only those it accepts;
        ``max_seqs``: no more once the batch holds that many sequences."""
        left = budget
        for req in q.phase_order(phase):
            if left <= 0 or batch.full or (max_seqs is not None and len(batch.seqs) >= max_seqs):
                break
            if req.state is ReqState.WAITING and not admit_new:
                break
            if only is None or only(req):
                left -= batch.prefill(req, left, phase)
        return budget - left

    def stats(self) -> dict[str, object]:
        return {"policy": self.name, **self.ctl.stats()}


class NoFeedback(AgentServe):
    name = "no-feedback"
    feedback = False


class NoPartition(AgentServe):
    name = "no-partition"
    lanes = (Lane.DECODE,)

    def control_ladder(self) -> Ladder:
        return Ladder([self.ladder.rungs[self.ladder.full]])

    def fill(self, lane: Lane, batch: Batch, q: Queues, now: float, other_rung: int | None):
        budget = self.ctl.b_prefill
        self.decode_all(batch, q)
        starving = self.starving(q, now)
        used = 0
        if starving:
            head = q.head(Phase.COLD)
            used = batch.prefill(head, self.config.guard.min_tokens, Phase.COLD)  # type: ignore[arg-type]
        used += self.add_prefills(batch, q, Phase.RESUME, max(0, budget - used), admit_new=not starving)
        self.add_prefills(batch, q, Phase.COLD, budget - used, max_seqs=self.config.scheduler.max_batch_seqs)
        return batch.num_decode + max(budget, used), self.ladder.full

    def stats(self) -> dict[str, object]:
        return {**super().stats(), "r_min_rung": self.ladder.full}
