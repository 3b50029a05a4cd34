"""Closed-loop agents against the scheduler and the fake executor, on a simulated clock.

Each agent runs turns: submit (cold prompt first, then a resume with the tool's output), decode
``max_tokens`` tokens, run its tool for ``tool_s`` seconds, and so on; after the last turn it closes
its session.  The run ends when every agent is done; running out of events with work left is a
liveness failure (:class:`Deadlock`).  Used by tests/scheduler and scripts/bench_scheduler.py.
"""

from __future__ import annotations

import heapq
import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from agentserve.orchestrator.scheduler.config import SchedulerConfig
from agentserve.orchestrator.scheduler.events import SeqEvent
from agentserve.orchestrator.scheduler.scheduler import Scheduler
from agentserve.protocol.lanes import Lane
from agentserve.protocol.ring_messages import Plan, Result
from agentserve.protocol.sampling import SamplingParams
from simulation.fake_executor import CostModel, FakeExecutor, ready


class Deadlock(AssertionError):
    """The simulation ran out of events while requests were still pending."""


@dataclass(frozen=True)
class SimTurn:
    new_tokens: int  # tokens appended: the cold prompt for the first turn, a tool output later
    max_tokens: int  # tokens decoded
    tool_s: float = 0.0  # tool latency after this turn (unused after the last)


@dataclass
class AgentSpec:
    start: float
    turns: list[SimTurn]
    system: list[int] = field(default_factory=list)  # shared prompt prefix of the first turn
    priority: int = 0
    seed: int = 0


@dataclass
class Step:
    lane: Lane
    rung: int
    t0: float
    t1: float
    n_decode: int
    n_prefill: int
    b_prefill: int | None


@dataclass
class SimReport:
    steps: list[Step]
    itl: dict[int, list[float]]  # seq_id -> inter-token gaps
    ttft: dict[int, float]
    submits: dict[int, float]
    services: dict[int, list[tuple[float, float]]]  # seq_id -> (plan issued, step end)
    turns_done: int
    turns_expected: int
    end_time: float
    stats: dict
    decide_us: list[float]  # CPU time of schedule() calls that produced messages
    overlaps: int
    result_us: list[float] = field(default_factory=list)  # CPU time of on_result() calls
    decide_wall_us: list[float] = field(default_factory=list)  # wall time of the same schedule() calls


class Sim:
    def __init__(
        self,
        policy: str,
        agents: list[AgentSpec],
        *,
        num_blocks: int = 8192,
        block_size: int = 16,
        cost: CostModel | None = None,
        config: SchedulerConfig | None = None,
        partitioned: bool = True,
        check_every: int = 0,
        max_time: float = 3600.0,
        vocab: int = 30000,
        probe: Callable[[Sim], None] | None = None,
    ) -> None:
        self.now = 0.0
        self.info = ready(num_blocks, block_size, max_model_len=num_blocks * block_size, partitioned=partitioned)
        self.sched = Scheduler(policy, self.info, config or SchedulerConfig(), clock=lambda: self.now)
        self.exe = FakeExecutor(self.info, cost, oracle=self._truth)
        self.agents, self.check_every, self.max_time, self.vocab = agents, check_every, max_time, vocab
        self.heap: list[tuple[float, int, str, object]] = []
        self.order = itertools.count()
        self.progress: dict[int, int] = {}  # agent -> next turn
        self.session: dict[int, str] = {}
        self.seq_agent: dict[int, int] = {}
        self.last_token_t: dict[int, float] = {}
        self.sent_at: dict[int, float] = {}
        self.report = SimReport([], {}, {}, {}, {}, 0, sum(len(a.turns) for a in agents), 0.0, {}, [], 0)
        self.plans = 0
        self.probe = probe

    def _truth(self, seq_id: int) -> list[int] | None:
        req = self.sched.requests.get(seq_id)
        return req.tokens if req is not None else None

    def _push(self, t: float, kind: str, data: object) -> None:
        heapq.heappush(self.heap, (t, next(self.order), kind, data))

    def run(self) -> SimReport:
        for i, agent in enumerate(self.agents):
            self._push(agent.start, "turn", i)
        while self.heap:
            t, _, kind, data = heapq.heappop(self.heap)
            if kind == "result" and data.t_end > t:  # type: ignore[attr-defined]
                self._push(data.t_end, kind, data)  # type: ignore[attr-defined]  # a plan ran inside it: later
                continue
            if t > self.max_time:
                raise Deadlock(f"simulation passed {self.max_time}s with work left")
            self.now = t
            if kind == "turn":
                self._submit(data, t)  # type: ignore[arg-type]
            else:
                self._result(data, t)  # type: ignore[arg-type]
            self._pump(t)
        if self.sched.requests or self.report.turns_done != self.report.turns_expected:
            raise Deadlock(f"no events left, {len(self.sched.requests)} requests pending: {self.sched.stats(self.now)}")
        self.report.end_time = self.now
        self.report.stats = self.sched.stats(self.now)
        self.report.overlaps = self.exe.overlaps
        return self.report

    def _tokens(self, agent: int, turn: int, n: int) -> list[int]:
        rng = random.Random(self.agents[agent].seed * 1_000_003 + agent * 1009 + turn)
        return [rng.randrange(10, self.vocab) for _ in range(n)]

    def _submit(self, agent: int, t: float) -> None:
        spec, turn = self.agents[agent], self.progress.get(agent, 0)
        if agent not in self.session:
            self.session[agent] = self.sched.open_session(f"agent-{agent}")
        new = self._tokens(agent, turn, spec.turns[turn].new_tokens)
        if turn == 0:
            new = list(spec.system) + new
        sampling = SamplingParams(max_tokens=spec.turns[turn].max_tokens, ignore_eos=True)
        seq = self.sched.submit(self.session[agent], new, sampling, priority=spec.priority, now=t)
        self.seq_agent[seq] = agent
        self.report.submits[seq] = t

    def _pump(self, t: float) -> None:
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        msgs = self.sched.schedule(t)
        if msgs:
            self.report.decide_us.append((time.thread_time_ns() - c0) / 1e3)
            self.report.decide_wall_us.append((time.perf_counter_ns() - t0) / 1e3)
        for msg in msgs:
            if isinstance(msg, Plan):
                self._send(msg, t)
            else:
                self.exe.release(msg)
        self._events(self.sched.take_events(), t)
        self.plans += 1
        if self.check_every and self.plans % self.check_every == 0:
            self.sched.check()
        if self.probe is not None:
            self.probe(self)

    def _send(self, plan: Plan, t: float) -> None:
        result = self.exe.run(plan, t)
        decoding = self.sched.q.decoding
        n_dec = sum(1 for s in plan.seqs if s.seq_id in decoding)
        n_pre = sum(len(s.token_ids) for s in plan.seqs if s.seq_id not in decoding)
        b = self.sched.policy.stats().get("b_prefill")
        self.report.steps.append(Step(plan.lane, plan.rung, result.t_start, result.t_end, n_dec, n_pre, b))
        for s in plan.seqs:
            self.report.services.setdefault(s.seq_id, []).append((t, result.t_end))
        self._push(result.t_end, "result", result)

    def _result(self, result: Result, t: float) -> None:
        c0 = time.thread_time_ns()
        events = self.sched.on_result(result, t)
        self.report.result_us.append((time.thread_time_ns() - c0) / 1e3)
        self._events(events, t)

    def _events(self, events: list[SeqEvent], t: float) -> None:
        for ev in events:
            if ev.token_id >= 0:
                if ev.first:
                    self.report.ttft[ev.seq_id] = ev.t - self.report.submits[ev.seq_id]
                else:
                    self.report.itl.setdefault(ev.seq_id, []).append(ev.t - self.last_token_t[ev.seq_id])
                self.last_token_t[ev.seq_id] = ev.t
            if ev.finished:
                self._turn_done(ev, t)

    def _turn_done(self, ev: SeqEvent, t: float) -> None:
        agent = self.seq_agent[ev.seq_id]
        spec, turn = self.agents[agent], self.progress.get(agent, 0)
        self.report.turns_done += 1
        self.progress[agent] = turn + 1
        if turn + 1 < len(spec.turns):
            self.sched.end_turn(ev.seq_id, True, now=t)
            self._push(t + spec.turns[turn].tool_s, "turn", agent)
        else:
            self.sched.end_turn(ev.seq_id, False, now=t)
            self.sched.close_session(self.session[agent], now=t)
