"""The scheduler: sessions and requests in, one ``Plan`` per free lane out.

Driving it (the server process does this; tests do it with a fake executor)::

    sched = Scheduler("agentserve", ready, load_config(), clock=time.monotonic)
    sid = sched.open_session()
    seq = sched.submit(sid, prompt_ids, SamplingParams(max_tokens=64))
    loop:
        for msg in sched.schedule():          # Release first, then Plans for lanes with room
            ring.put(msg)
        for result in results_from_ring():
            for ev in sched.on_result(result):  # SeqEvent: token, first-token flag, finish
                stream(ev)
                if ev.finished:
                    sched.end_turn(ev.seq_id, in_tool_call=parsed_a_tool_call)
    sched.close_session(sid)

Public API (all ``now`` arguments default to ``clock()``):

- ``open_session(session_id=None) -> str``
- ``submit(session_id, token_ids, sampling=None, *, priority=0, full_prompt=False, now=None) -> int``
  — start a turn.  ``token_ids`` are appended to the conversation, or with ``full_prompt`` are the
  whole conversation (the cached part is kept up to the first differing block).  Returns the
  turn's ``seq_id``.  Raises ``ValueError`` for a prompt that can never fit, ``KeyError`` for an
  unknown session, ``RuntimeError`` when the session already runs a turn.
- ``abort(seq_id, now=None, failure=None) -> list[SeqEvent]`` — stop a turn (at once, or when its step
  returns) with ``Finish.ABORT``; with ``failure`` (a step of it failed) ``Finish.ERROR``, which wins
  over a pending abort.  ``failure(seq_id)`` is that reason.
- ``end_turn(seq_id, in_tool_call, now=None)`` — the turn's output was parsed: in a tool call, the
  session's blocks stay pinned for a TTL learned from its tool latencies; otherwise released.
- ``close_session(session_id, now=None) -> list[SeqEvent]`` — abort its turn, free its blocks.
- ``schedule(now=None) -> list[Plan | Release]`` — a lane holds one Plan in flight (the decode lane up
  to ``1 + decode_lookahead`` while nothing waits to be prefilled); a Plan is in flight until its Result.
- ``on_result(result, now=None) -> list[SeqEvent]``; ``on_error(error, now=None)`` likewise (the failed
  plan's sequences, and those of plans queued behind it, end with ``Finish.ERROR``).
- ``stats(now=None) -> dict`` — queues per class, rung, B_prefill, KV use, prefix hits, TPOT/TTFT.
- ``take_events() -> list[SeqEvent]`` — events produced outside ``on_result`` (call after
  ``schedule``/``end_turn``; ``on_result`` also returns them first).
- ``idle() -> bool``; ``check()`` asserts every KV invariant (tests).

Memory pressure, in order: free blocks; LRU eviction of cached blocks; preemption by recompute of
the lowest-priority running request not in flight (blocks freed, ``Release`` sent, re-queued at the
front of its class, re-prefilled later); breaking the oldest retention pin.  When nothing runs, is in
flight or can be preempted and admission still fails, pins are broken too, so waiting work always
progresses.  A request alone that cannot grow stops with ``Finish.LENGTH`` (never dropped).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec

from agentserve.orchestrator.policies import make_policy
from agentserve.orchestrator.policies.base import Policy
from agentserve.orchestrator.scheduler.batch import Batch, Entry
from agentserve.orchestrator.scheduler.config import SchedulerConfig, allowed_here, load_config
from agentserve.orchestrator.scheduler.events import SeqEvent
from agentserve.orchestrator.scheduler.kv_manager import Admit, KVManager
from agentserve.orchestrator.scheduler.queues import Queues
from agentserve.orchestrator.scheduler.request import Phase, ReqState, Request
from agentserve.orchestrator.scheduler.rungs import Ladder
from agentserve.orchestrator.scheduler.session_kv import SessionKV, tool_ttl
from agentserve.orchestrator.scheduler.window import Window
from agentserve.protocol.lanes import Lane, backend_unit
from agentserve.protocol.ring_messages import ExecError, Plan, Ready, Release, Result, SeqResult
from agentserve.protocol.sampling import Finish, SamplingParams
from agentserve.protocol.stopping import finish_reason

log = logging.getLogger(__name__)

STATS_WINDOW_S = 10.0
PHASE_RANK = {Phase.COLD: 0, Phase.RESUME: 1, Phase.DECODE: 2}
_COUNTER = {Finish.ABORT: "aborted", Finish.ERROR: "failed"}  # counter of each end; the rest "finished"


def _failed(req: Request, why: str) -> None:
    """Record the first failure a request meets (the one the client is told); it will end with ERROR."""
    req.failure = req.failure or why or "no reason given (see the server log)"


def _stop_reason(req: Request) -> Finish:
    """How a stopped request ends: ERROR once a step of it failed (that wins over a client's abort)."""
    return Finish.ERROR if req.failure else Finish.ABORT


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class Inflight:
    __slots__ = ("step", "rung", "entries", "sent", "preempted")

    def __init__(self, step: int, rung: int, entries: list[Entry], sent: float) -> None:
        self.step, self.rung, self.entries, self.sent = step, rung, entries, sent
        self.preempted = 0  # preempting plans sent to run inside this one


class Scheduler:
    def __init__(
        self,
        policy: str | Policy,
        ready: Ready,
        config: SchedulerConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_landed: Callable[[Result, list[Entry], float, dict[str, Any]], None] | None = None,
    ) -> None:
        self.config = config or load_config()
        self.clock = clock
        # told of each landed step: its result, its plan's entries, when it was planned, and the policy state
        self.on_landed = on_landed
        cc = self.config.controller
        unit = backend_unit(ready.backend)
        self.ladder = Ladder(ready.ladder, cc.r_min_lo_share, cc.r_min_hi_share, unit,
                             full_on_top=allowed_here(cc.full_rung_on_top, unit))
        self.policy = make_policy(policy, self.config, self.ladder) if isinstance(policy, str) else policy
        self.kv = KVManager(ready.num_blocks, ready.block_size)
        capacity = ready.num_blocks * ready.block_size
        self.max_len = min(ready.max_model_len, capacity) if ready.max_model_len > 0 else capacity
        self.eos = frozenset(ready.eos_token_ids)
        self.q = Queues()
        self.sessions: dict[str, SessionKV] = {}
        self.requests: dict[int, Request] = {}  # unfinished turns
        self.ended: dict[int, Request] = {}  # finished turns awaiting end_turn()
        self.letting_go: dict[int, Request] = {}  # finished, but plans sent ahead are still running
        self.held: dict[str, SessionKV] = {}  # sessions holding blocks (pinned or in grace)
        self.next_expiry = math.inf
        self.lanes: dict[Lane, deque[Inflight]] = {lane: deque() for lane in self.policy.lanes}
        self.preempting: deque[Inflight] = deque()  # a plan running inside the prefill lane's (at most one)
        self.lookahead = self.config.scheduler.decode_lookahead
        self.releases: list[int] = []
        self.seq_ids = itertools.count(1)
        self.steps = itertools.count(1)
        self.tpot_ctl = Window(cc.window_s)  # the controller's window (cleared on each change)
        self.tpot = Window(STATS_WINDOW_S)
        self.ttft = Window(STATS_WINDOW_S)
        self.pending_events: list[SeqEvent] = []
        self.tool_samples: deque[float] = deque(maxlen=256)
        self.counters = dict.fromkeys(("preemptions", "pins_broken", "finished", "aborted", "failed", "plans"), 0)

    # ---------------------------------------------------------------- sessions and turns
    def open_session(self, session_id: str | None = None) -> str:
        session_id = session_id or uuid.uuid4().hex
        if session_id in self.sessions:
            raise ValueError(f"session {session_id!r} is already open")
        self.sessions[session_id] = SessionKV(session_id)
        return session_id

    def submit(
        self,
        session_id: str,
        token_ids: list[int],
        sampling: SamplingParams | None = None,
        *,
        priority: int = 0,
        full_prompt: bool = False,
        now: float | None = None,
    ) -> int:
        now = self.clock() if now is None else now
        session = self.sessions[session_id]
        if session.active is not None:
            raise RuntimeError(f"session {session_id!r} already runs turn {session.active.seq_id}")
        sampling = sampling or SamplingParams()
        sampling.validate()
        previous = session.tokens
        tokens = list(token_ids) if full_prompt else previous + list(token_ids)
        if not tokens or len(tokens) >= self.max_len:
            raise ValueError(f"prompt of {len(tokens)} tokens does not fit (max {self.max_len - 1})")
        common = _common_prefix(previous, tokens) if full_prompt else len(previous)
        if full_prompt:
            self._truncate_session(session, tokens, common)
        session.observe_tool_return(now, self.tool_samples)
        self._claim(session)
        req = Request(next(self.seq_ids), session, tokens, sampling, priority, now)
        valid = common // self.kv.block_size  # block hashes of the shared conversation prefix
        req.hashes, req.keys = session.hashes[:valid], session.keys[:valid]
        self._classify(req, self.kv.peek_cached(req))
        session.active = req
        self.requests[req.seq_id] = req
        self.q.push_waiting(req)
        return req.seq_id

    def abort(self, seq_id: int, now: float | None = None, failure: str | None = None) -> list[SeqEvent]:
        """Stop a running request: now, or (plans in flight) when they are back.  It ends with ABORT, or
        with ERROR when ``failure`` (a step of it failed) or an earlier failure is recorded."""
        now = self.clock() if now is None else now
        req = self.requests.get(seq_id)
        if req is None:
            return []
        if failure is not None:
            _failed(req, failure)
        if req.inflight:
            req.abort_pending = True
            return []
        return [self._finish(req, _stop_reason(req), now)]

    def end_turn(self, seq_id: int, in_tool_call: bool, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        running = self.requests.get(seq_id)
        req = running or self.ended.get(seq_id)
        if req is None:
            return
        if in_tool_call:  # the tool runs from now, whenever the turn's blocks come back
            req.session.tool_started = now
        if running is not None:  # still running: stop it; applied now, or when its step is back
            req.end_tool = in_tool_call
            self.pending_events += self.abort(seq_id, now)
            return
        if req.inflight:  # finished with plans still out: its blocks come back with the last result
            req.end_tool = in_tool_call
            return
        del self.ended[seq_id]
        self._end(req, in_tool_call, now)

    def _end(self, req: Request, in_tool_call: bool, now: float) -> None:
        session = req.session
        if session.active is not None or not session.holds_blocks:
            return  # nothing retained, or the next turn already claimed the blocks
        if in_tool_call and self.policy.retain_on_tool_call:
            self._pin(session, now + tool_ttl(session, self.tool_samples, self.config.kv))
        else:
            self._release_session(session)

    def close_session(self, session_id: str, now: float | None = None) -> list[SeqEvent]:
        now = self.clock() if now is None else now
        session = self.sessions.get(session_id)
        if session is None:
            return []
        session.closed = True
        events = self.abort(session.active.seq_id, now) if session.active else []
        if session.active is None:
            self._drop_session(session)
        return events

    # ---------------------------------------------------------------- stepping
    def schedule(self, now: float | None = None) -> list[Plan | Release]:
        now = self.clock() if now is None else now
        if now >= self.next_expiry:
            self._expire_pins(now)
        self.policy.tick(self.tpot_ctl, now)
        plans, blocked = self._plan_lanes(now)
        while not plans and blocked and self.idle_lanes() and not self.q.num_active() and self._break_pin():
            plans, blocked = self._plan_lanes(now)  # liveness: nothing else will ever free blocks
        if self.releases:
            plans.insert(0, Release(self.releases))
            self.releases = []
        return plans

    def take_events(self) -> list[SeqEvent]:
        """Events produced outside ``on_result`` (a turn stopped inside ``schedule``/``end_turn``)."""
        events, self.pending_events = self.pending_events, []
        return events

    def on_result(self, result: Result, now: float | None = None) -> list[SeqEvent]:
        now = self.clock() if now is None else now
        inflight = self._land(result.lane, result.step)
        events = self.take_events()
        if inflight is None:
            return events
        if self.on_landed is not None:
            self.on_landed(result, inflight.entries, inflight.sent, self.policy.stats())
        sampled = {s.seq_id: s for s in result.seqs}
        bs = self.kv.block_size
        for req, n, sample, decode in inflight.entries:
            if self._landed(req, decode, now):  # a plan sent ahead of its finish: nothing to take
                continue
            req.num_computed += n
            if req.num_computed >= (req.num_ready + 1) * bs:
                self.kv.on_computed(req)
            if sample:
                sr = sampled.get(req.seq_id)
                if sr is None or sr.token_id < 0:
                    log.error("result of step %d has no token for seq %d", result.step, req.seq_id)
                    _failed(req, f"step {result.step} returned no token for it")
                    events.append(self._finish(req, Finish.ERROR, now))
                    continue
                events.append(self._append(req, sr, now))
            if req.abort_pending and req.state is not ReqState.FINISHED:
                events.append(self._finish(req, _stop_reason(req), now))
        return events

    def on_error(self, error: ExecError, now: float | None = None) -> list[SeqEvent]:
        """The executor failed a step: its sequences finish with ``Finish.ERROR`` (their lanes freed).

        Plans queued behind the failed one still run on the executor and still report, so they stay
        in flight (their requests finish with ERROR too when they land, and only then give up blocks);
        a fatal error clears everything, the executor is going away.
        """
        now = self.clock() if now is None else now
        events = []
        for queue in (*self.lanes.values(), self.preempting):
            if error.fatal:
                failed = list(queue)
                queue.clear()
            elif any(p.step == error.step for p in queue):
                failed = []
                while queue:  # the failed plan, and any before it (results arrive in plan order)
                    failed.append(queue.popleft())
                    if failed[-1].step == error.step:
                        break
                for req, _, _, _ in (e for p in queue for e in p.entries):
                    req.abort_pending = True
                    _failed(req, error.message)
            else:
                continue
            for req, _, _, decode in (e for p in failed for e in p.entries):
                _failed(req, error.message)
                if not self._landed(req, decode, now):
                    events.append(self._finish(req, Finish.ERROR, now))
        for seq_id in error.seq_ids:
            events += self.abort(seq_id, now, failure=error.message)
        return events

    def failure(self, seq_id: int) -> str:
        """Why a turn finished with ``Finish.ERROR`` (asked of ERROR turns only; "" once it is forgotten)."""
        req = self.requests.get(seq_id) or self.ended.get(seq_id)
        return req.failure if req is not None else ""

    def cached_tokens(self, seq_id: int) -> int:
        """Prompt tokens of a turn served from the KV cache (0 once the turn is forgotten)."""
        req = self._turn(seq_id)
        return req.num_cached if req is not None else 0

    def first_served(self, seq_id: int) -> float | None:
        """When a turn was first in a step (the end of its queueing); None if never, or once it is forgotten."""
        req = self._turn(seq_id)
        return req.first_service_t if req is not None else None

    def _turn(self, seq_id: int) -> Request | None:
        return self.requests.get(seq_id) or self.ended.get(seq_id)

    def idle(self) -> bool:
        return not self.requests and self.idle_lanes()

    def idle_lanes(self) -> bool:
        return not any(self.lanes.values()) and not self.preempting

    # ---------------------------------------------------------------- batch host
    def admit(self, req: Request, batch: Batch) -> bool:
        """Give a waiting request blocks and move it to its prefill queue (its class rechecked).  Not while its
        session's previous turn, finished, still has plans out and will keep its table: that comes back with the
        turn's last plan, about one decode step away, and goes to ``req`` then (:meth:`_hand_on`)."""
        if any(r.session is req.session and self._keeps_table(r) for r in self.letting_go.values()):
            return False
        result = self.kv.admit(req)
        if result is Admit.NO_SPACE:
            batch.blocked = True
        if result is not Admit.OK:
            return False
        self.q.waiting[req.phase].remove(req)
        self._classify(req, req.num_computed)
        self.q.admitted(req)
        return True

    def grow(self, req: Request, num_positions: int, batch: Batch) -> bool:
        """Blocks for ``req`` up to ``num_positions``, preempting or unpinning others if needed."""
        while not self.kv.grow(req, num_positions):
            victim = self._victim(req, batch)
            if victim is not None:
                self._preempt(victim, batch.now)
            elif not self._break_pin():
                self._stuck(req, batch)
                return False
        return True

    def sampling_for(self, req: Request) -> SamplingParams:
        if req.num_output == 0:
            return req.sampling
        seen = req.tokens[req.num_prompt:] if req.sampling.grammar else []  # the grammar resumes after them
        return msgspec.structs.replace(req.sampling, max_tokens=max(1, req.remaining_tokens), grammar_prefix=seen)

    # ---------------------------------------------------------------- internals
    def _plan_lanes(self, now: float) -> tuple[list[Plan | Release], bool]:
        plans: list[Plan | Release] = []
        blocked = False
        # Decode plans are queued ahead only while nothing waits to be prefilled: a plan decided
        # ahead would keep a newly arrived prefill (and a guard-forced rung change) one step longer.
        ahead = 0 if self.q.has_prefill_work() else self.lookahead
        first = self.policy.preempts_first()
        if first:
            blocked |= self._plan_preempting(now, plans)
        for lane in self.policy.lanes:
            depth = 1 + (ahead if lane is Lane.DECODE else 0)
            while len(self.lanes[lane]) < depth:  # a lane runs its plans in order
                plan, lane_blocked = self._plan_lane(lane, now)
                blocked |= lane_blocked
                if plan is None:
                    break
                plans.append(plan)
        if not first:
            blocked |= self._plan_preempting(now, plans)
        if not self.q.decoding and not self.lanes.get(Lane.DECODE):  # decode plans sent in this call are in flight
            for plan in plans:
                if isinstance(plan, Plan) and plan.lane is Lane.PREFILL:
                    plan.decode_idle = True
        return plans, blocked

    def _plan_preempting(self, now: float, plans: list[Plan | Release]) -> bool:
        """Append a plan to run inside the prefill lane's plan in flight, if the policy has one; whether admission
        was blocked.  Never into a plan sent in this same call (``plans``), never two at once."""
        running = self.lanes.get(Lane.PREFILL)
        sent_now = any(p.lane is Lane.PREFILL for p in plans if isinstance(p, Plan))
        if running is None or len(running) != 1 or self.preempting or sent_now:
            return False
        plan, blocked = self._plan_lane(Lane.PREFILL, now, running[0])
        if plan is not None:
            plans.append(plan)
        return blocked

    def _plan_lane(self, lane: Lane, now: float, running: Inflight | None = None) -> tuple[Plan | None, bool]:
        """The lane's next plan; with ``running`` (the prefill lane's plan in flight) a plan to run inside it."""
        batch = Batch(self, lane, self.policy.max_seqs(lane), now, self.kv.block_size)
        if running is None:
            decision = self.policy.fill(lane, batch, self.q, now, self._other_rung(lane))
        else:
            decision = self.policy.fill_preempting(batch, self.q, now, running.entries, running.preempted)
        if decision is None or not batch.seqs:
            return None, batch.blocked
        budget, rung = decision
        step = next(self.steps)
        for req, _, _, decode in batch.entries:
            req.inflight += 1
            req.ahead += decode
        if running is None:
            self.lanes[lane].append(Inflight(step, rung, batch.entries, now))
        else:
            running.preempted += 1
            self.preempting.append(Inflight(step, running.rung, batch.entries, now))
            rung = running.rung
        self.counters["plans"] += 1
        hold = self.policy.holds_decode_cores(lane, batch)
        return Plan(step, lane, rung, budget, batch.seqs, preempt=running is not None, hold_cores=hold), batch.blocked

    def _other_rung(self, lane: Lane) -> int | None:
        """The rung the other lane holds: the full rung if any of its queued plans is on it, else its last."""
        rungs = [p.rung for k, q in self.lanes.items() if k is not lane for p in q]
        if lane is not Lane.PREFILL:
            rungs += [p.rung for p in self.preempting]  # it holds the prefill lane's rung until it is back
        if not rungs:
            return None
        return self.ladder.full if self.ladder.full in rungs else rungs[-1]

    def _land(self, lane: Lane, step: int) -> Inflight | None:
        """The plan this result answers; None (logged) for a result of no plan we still track."""
        if self.preempting and self.preempting[0].step == step and lane is Lane.PREFILL:
            return self.preempting.popleft()  # it ran inside the lane's plan in flight, so it is back first
        queue = self.lanes.get(lane)
        if not queue or queue[0].step != step:
            log.error("result for step %d on lane %s, which has no such plan next: ignored", step, lane.name)
            return None
        return queue.popleft()

    def _append(self, req: Request, sr: SeqResult, now: float) -> SeqEvent:
        token, finish = sr.token_id, sr.finish
        req.tokens.append(token)
        req.num_output += 1
        first = req.first_token_t is None
        if req.state is ReqState.PREFILL:
            self.q.to_decode(req)
        if first:
            req.first_token_t = now
            self.ttft.add(now, now - req.arrival)
        else:
            self.tpot.add(now, now - req.last_token_t)
            self.tpot_ctl.add(now, now - req.last_token_t)
        req.last_token_t = now
        if finish is Finish.NONE:
            finish = finish_reason(token, req.num_output, req.sampling, self.eos, len(req.tokens), self.max_len)
        if finish is not Finish.NONE:
            return self._finish(req, finish, now, first, sr)
        return SeqEvent.of(req.seq_id, req.session.session_id, sr, finish, first, req.num_output, now)

    def _finish(
        self, req: Request, reason: Finish, now: float, first: bool = False, sr: SeqResult | None = None
    ) -> SeqEvent:
        """``req`` ends for ``reason``; ``sr``: the result whose token ended it (None: no new token)."""
        self.q.remove(req)
        had_kv = req.state is ReqState.DECODE
        req.state, req.finish = ReqState.FINISHED, reason
        del self.requests[req.seq_id]
        self.counters[_COUNTER.get(reason, "finished")] += 1
        session = req.session
        session.active = None
        session.tokens, session.hashes, session.keys = req.tokens, req.hashes, req.keys
        req.had_kv = had_kv
        event = SeqEvent.of(req.seq_id, session.session_id, sr, reason, first, req.num_output, now)
        if req.inflight:  # plans sent ahead may still write its blocks: keep them until they are back
            self.letting_go[req.seq_id] = req
            self.ended[req.seq_id] = req
        else:
            self._let_go(req, now)
        return event

    def _landed(self, req: Request, decode: bool, now: float) -> bool:
        """One planned entry of ``req`` is back (or failed). True when ``req`` had already finished; the
        last entry back of a finished request lets it go."""
        req.inflight -= 1
        req.ahead -= decode
        if req.state is not ReqState.FINISHED:
            return False
        if not req.inflight:
            self._let_go(req, now)
        return True

    def _let_go(self, req: Request, now: float) -> None:
        """A finished request with nothing in flight: Release it, hand its blocks on or free them."""
        self.letting_go.pop(req.seq_id, None)
        if req.sampling_sent or req.blocks_sent:
            self.releases.append(req.seq_id)
        session = req.session
        retain = self._keeps_table(req)
        after = session.active  # the session's next turn, if it came while this one's plans were still running
        moved_on = after is None and session.tokens is not req.tokens  # ... and ended before them (an abort)
        if moved_on and session.holds_blocks:
            retain = False  # the session holds that later turn's table: keep it
        if retain and not session.closed and (after is None or after.state is ReqState.WAITING):
            self.kv.retain(req, session)
            if after is not None:
                self._hand_on(session, req, after)
            else:
                if moved_on:  # kept only as far as the conversation since agrees with this turn's tokens
                    conversation = session.tokens
                    self._truncate_session(session, conversation, _common_prefix(req.tokens, conversation))
                    session.tokens = conversation
                if session.holds_blocks:
                    self._pin(session, now + self.config.kv.turn_end_grace_s)
        else:
            self.kv.free(req)
            if session.active is None and not moved_on:
                self._release_session(session)
        if session.closed:
            self._drop_session(session)
        elif req.end_tool is not None:
            self.ended.pop(req.seq_id, None)
            self._end(req, req.end_tool, now)
        else:
            self.ended[req.seq_id] = req

    def _keeps_table(self, req: Request) -> bool:
        """Whether ``req``, letting go, offers its table to its session (it computed KV and the policy retains)."""
        return bool(req.had_kv and req.block_table and self.policy.retains)

    def _hand_on(self, session: SessionKV, req: Request, after: Request) -> None:
        """``req``'s table, just retained by its session, for the session's next turn ``after``, which arrived before
        ``req`` let go (a tool answered at once) and waits for admission: kept up to the longest prefix the two share,
        as when the turn comes later, and ``after`` classed again by it (it was classed by the prefix cache alone)."""
        self._truncate_session(session, after.tokens, _common_prefix(req.tokens, after.tokens))
        self._claim(session)
        phase = after.phase
        self._classify(after, self.kv.peek_cached(after))
        if after.phase is not phase:  # into its new class's waiting queue
            self.q.waiting[phase].remove(after)
            self.q.push_waiting(after)

    def _preempt(self, req: Request, now: float) -> None:
        self.q.remove(req)
        if req.sampling_sent or req.blocks_sent:
            self.releases.append(req.seq_id)
        self.kv.free(req)
        req.sampling_sent = False
        req.preemptions += 1
        self.counters["preemptions"] += 1
        self._classify(req, self.kv.peek_cached(req))
        req.queued_since = now
        self.q.push_waiting(req, front=True)

    def _victim(self, req: Request, batch: Batch) -> Request | None:
        """The lowest-ranked block holder that is not in flight, in this batch, or above ``req``."""
        best, best_key = None, None
        for r in self.q.holders():
            if r is req or r.inflight or r.seq_id in batch.in_batch or not r.block_table:
                continue
            key = (r.priority, PHASE_RANK[r.phase], -r.arrival)
            if best_key is None or key < best_key:
                best, best_key = r, key
        if best is None or best_key > (req.priority, PHASE_RANK[req.phase], -req.arrival):  # type: ignore[operator]
            return None
        return best

    def _stuck(self, req: Request, batch: Batch) -> None:
        """``req`` cannot grow and nothing can be reclaimed for it now."""
        if req.inflight:
            return  # its earlier plans are still running: try again when they are back
        others = self.kv.pool.num_used() > len(set(req.block_table))
        if others:
            self._preempt(req, batch.now)  # others will finish and free their blocks
        else:
            self.pending_events.append(self._finish(req, Finish.LENGTH, batch.now))

    def _classify(self, req: Request, cached: int) -> None:
        """Its phase from the prompt tokens not cached (``cached`` are), which it keeps with it."""
        req.num_uncached_at_class = uncached = len(req.tokens) - cached
        req.phase = Phase.COLD if uncached > self.config.scheduler.cold_threshold_tokens else Phase.RESUME

    def _truncate_session(self, session: SessionKV, tokens: list[int], common: int) -> None:
        """Keep the session's retained KV only for the longest block-aligned common prefix."""
        keep_tokens = min(common, session.num_computed, len(tokens) - 1)
        keep = keep_tokens // self.kv.block_size
        if session.holds_blocks and keep_tokens < session.num_computed:
            self.kv.pool.release(session.block_table[keep:])
            del session.block_table[keep:]
            session.num_computed = keep * self.kv.block_size
            session.num_sealed = min(session.num_sealed, keep)
            if not session.block_table:
                self._release_session(session)
        session.tokens = tokens[: session.num_computed] if session.holds_blocks else []

    # ---------------------------------------------------------------- retention pins
    def _pin(self, session: SessionKV, deadline: float) -> None:
        session.pin_deadline = deadline
        self.held[session.session_id] = session
        self.next_expiry = min(self.next_expiry, deadline)

    def _claim(self, session: SessionKV) -> None:
        """A new turn will take the session's blocks at admission: keep them until then."""
        if session.holds_blocks:
            session.pin_deadline = math.inf
            self.held[session.session_id] = session
        else:
            self.held.pop(session.session_id, None)

    def _release_session(self, session: SessionKV) -> None:
        self.kv.release_session(session)
        self.held.pop(session.session_id, None)

    def _expire_pins(self, now: float) -> None:
        expired = [s for s in self.held.values() if s.pin_deadline is not None and s.pin_deadline <= now]
        for session in expired:
            self._release_session(session)
        self.next_expiry = min((s.pin_deadline or math.inf for s in self.held.values()), default=math.inf)

    def _break_pin(self) -> bool:
        """Release the pin that expires first (claimed ones last); False when none is left."""
        holding = [s for s in self.held.values() if s.holds_blocks]
        if not holding:
            return False
        session = min(holding, key=lambda s: s.pin_deadline if s.pin_deadline is not None else math.inf)
        self._release_session(session)
        self.counters["pins_broken"] += 1
        return True

    def _drop_session(self, session: SessionKV) -> None:
        self._release_session(session)
        if self.sessions.get(session.session_id) is session:  # not a session re-opened under its id meanwhile
            del self.sessions[session.session_id]
        for seq_id in [k for k, r in self.ended.items() if r.session is session]:
            del self.ended[seq_id]

    # ---------------------------------------------------------------- introspection
    def stats(self, now: float | None = None) -> dict[str, object]:
        now = self.clock() if now is None else now
        pool, kv = self.kv.pool, self.kv
        in_tool = sum(1 for s in self.sessions.values() if s.active is None and s.tool_started is not None)
        return {
            **self.policy.stats(),
            "queues": self.q.counts(),
            "sessions": len(self.sessions),
            "sessions_in_tool": in_tool,
            "lanes_busy": {lane.name.lower(): bool(q) or (lane is Lane.PREFILL and bool(self.preempting))
                           for lane, q in self.lanes.items()},
            "kv": {
                "blocks": pool.num_blocks,
                "used": pool.num_used(),
                "cached": len(pool.cached),
                "free": len(pool.free),
                "held_by_sessions": len({b for s in self.held.values() for b in s.block_table}),  # shared: once
                "usage": pool.num_used() / pool.num_blocks,
                "evictions": pool.evictions,
            },
            "prefix_hit_rate": kv.hit_tokens / kv.prompt_tokens if kv.prompt_tokens else 0.0,
            "tpot_s": self.tpot.summary(now),
            "ttft_s": self.ttft.summary(now),
            **self.counters,
        }

    def check(self) -> None:
        """Assert the KV invariants: refcounts equal the references held, no block held twice."""
        holders: dict[int, int] = {}
        for table in itertools.chain(
            (r.block_table for r in self.q.holders()),
            (s.block_table for s in self.sessions.values()),
            (r.block_table for r in self.letting_go.values()),
        ):
            assert len(set(table)) == len(table), "a block appears twice in one table"
            for bid in table:
                holders[bid] = holders.get(bid, 0) + 1
        for phase in self.q.waiting:
            for r in self.q.waiting[phase]:
                assert not r.block_table, f"waiting request {r.seq_id} holds blocks"
        self.kv.pool.check(holders)
        for r in self.q.holders():
            assert len(r.block_table) >= self.kv.blocks_for(r.num_computed), f"{r} lacks blocks for its KV"
