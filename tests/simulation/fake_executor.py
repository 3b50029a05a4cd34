"""A fake executor for tests and benchmarks: a cost model for time, a token store for checking KV.

Time: a lane step on a rung takes ``(a + b·decodes)/s_d^γd + c·prefill_tokens/s_p^γp`` where ``s`` is
the lane's share of the device on that rung (decode share for the decode lane, prefill share for the
prefill lane); on an unpartitioned rung both lanes see the whole device, and a step that starts
while the other lane is busy is slower: decode, which has priority there, ``decode_shared_slowdown``
times; prefill, which gets what decode leaves, ``shared_slowdown`` times.

A preempting plan (``Plan.preempt``) runs at once inside the prefill lane's step in flight when it ends
before that step would: its own result comes back first and the running step's ``t_end`` (the Result
object already returned) moves later by its duration; otherwise it runs after, as a plain plan would.

Checks, the executor's half of the wire contract: a new sequence comes with its sampling
parameters; every position fed lies in the sequence's block table; the KV it attends to (positions
before ``start_pos``, possibly written by *other* sequences through shared prefix blocks) holds
exactly the tokens the orchestrator believes (``oracle``); no block is written while another live
sequence has it in its table.  Violations raise :class:`ContractError`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from agentserve.orchestrator.scheduler.rungs import Ladder
from agentserve.protocol.lanes import Lane, Rung
from agentserve.protocol.ring_messages import Plan, Ready, Release, Result, SeqResult
from agentserve.protocol.sampling import Finish, SamplingParams
from agentserve.protocol.stopping import finish_reason

EOS = 2


class ContractError(AssertionError):
    """The orchestrator broke the executor's contract."""


@dataclass(frozen=True)
class CostModel:
    a: float = 0.008  # fixed cost of a step (s)
    b: float = 0.0003  # per decode sequence
    c: float = 0.00005  # per prefill token
    decode_exp: float = 0.5  # decode is memory-bound: less sensitive to its share of units
    prefill_exp: float = 1.0
    shared_slowdown: float = 2.0  # a prefill-lane step beside a busy decode lane on the shared rung
    decode_shared_slowdown: float = 1.1  # a decode-lane step beside a busy prefill lane (decode has priority)

    def step_time(self, n_decode: int, n_prefill: int, share: float, contended: bool, lane: Lane = Lane.DECODE
                  ) -> float:
        share = max(share, 1e-3)
        t = (self.a + self.b * n_decode) / share**self.decode_exp + self.c * n_prefill / share**self.prefill_exp
        if not contended:
            return t
        return t * (self.decode_shared_slowdown if lane is Lane.DECODE else self.shared_slowdown)


def ladder(total: int = 10, partitioned: bool = True) -> list[Rung]:
    """A ladder shaped like the executor's: decode 1..total-1 of ``total`` units, then the full rung
    (unpartitioned: both lanes may use all ``total`` units)."""
    rungs = []
    if partitioned:
        rungs = [
            Rung(index=i, decode_units=i + 1, prefill_units=total - i - 1, partitioned=True) for i in range(total - 1)
        ]
    rungs.append(Rung(index=len(rungs), decode_units=total, prefill_units=total, partitioned=False))
    return rungs


def ready(num_blocks: int, block_size: int = 16, max_model_len: int = 8192, partitioned: bool = True,
          backend: str = "fake") -> Ready:
    return Ready(
        wire_version=1, pid=0, num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len,
        vocab_size=32000, eos_token_ids=[EOS], backend=backend, reason="test", ladder=ladder(partitioned=partitioned),
    )  # fmt: skip


class _Seq:
    __slots__ = ("table", "last", "generated", "sampling", "computed", "finished")

    def __init__(self, sampling: SamplingParams) -> None:
        self.table: list[int] = []
        self.last = -1
        self.generated = 0
        self.sampling = sampling
        self.computed = 0
        self.finished = False


class FakeExecutor:
    def __init__(
        self,
        info: Ready,
        cost: CostModel | None = None,
        oracle: Callable[[int], list[int] | None] | None = None,
    ) -> None:
        self.info, self.cost, self.oracle = info, cost or CostModel(), oracle
        self.bs = info.block_size
        self.rungs = {r.index: r for r in info.ladder}
        self.total = Ladder(info.ladder).total
        self.kv: list[int | None] = [None] * (info.num_blocks * info.block_size)
        self.seqs: dict[int, _Seq] = {}
        self.users: dict[int, set[int]] = {}
        self.busy_until = {Lane.DECODE: 0.0, Lane.PREFILL: 0.0}
        self.busy_rung = {Lane.DECODE: -1, Lane.PREFILL: -1}
        self.running: dict[Lane, Result | None] = {Lane.DECODE: None, Lane.PREFILL: None}  # each lane's last step
        self.overlaps = 0  # steps started on a shared rung while the other lane was busy

    def release(self, msg: Release) -> None:
        for seq_id in msg.seq_ids:
            seq = self.seqs.pop(seq_id, None)
            for bid in seq.table if seq else ():
                self.users[bid].discard(seq_id)

    def duration(self, plan: Plan, now: float) -> float:
        rung = self.rungs[plan.rung]
        other = Lane.PREFILL if plan.lane is Lane.DECODE else Lane.DECODE
        other_busy = self.busy_until[other] > now
        units = rung.decode_units if plan.lane is Lane.DECODE or not rung.partitioned else rung.prefill_units
        share = units / self.total if rung.partitioned else 1.0
        contended = other_busy and not (rung.partitioned and self.rungs[self.busy_rung[other]].partitioned)
        self.overlaps += contended
        n_decode = sum(1 for s in plan.seqs if len(s.token_ids) <= 1 and s.sample and s.seq_id in self.seqs)
        n_prefill = sum(len(s.token_ids) for s in plan.seqs) - n_decode
        return self.cost.step_time(n_decode, n_prefill, share, contended, plan.lane)

    def run(self, plan: Plan, now: float) -> Result:
        """Execute ``plan`` when its lane is free (plans of one lane run in order); ``t_end`` says when."""
        inside = self.running[plan.lane] if plan.preempt else None
        start = max(now, self.busy_until[plan.lane])
        dt = self.duration(plan, now if inside is not None else start)
        out = [r for r in (self._feed(s) for s in plan.seqs) if r is not None]
        if inside is not None and now + dt < inside.t_end:  # at the running step's next layer boundary
            inside.t_end += dt
            self.busy_until[plan.lane] += dt
            return Result(step=plan.step, lane=plan.lane, rung=plan.rung, seqs=out, t_start=now, t_end=now + dt)
        self.busy_until[plan.lane], self.busy_rung[plan.lane] = start + dt, plan.rung
        result = Result(step=plan.step, lane=plan.lane, rung=plan.rung, seqs=out, t_start=start, t_end=start + dt)
        self.running[plan.lane] = result
        return result

    def _feed(self, sp) -> SeqResult | None:
        seq = self.seqs.get(sp.seq_id)
        if seq is None:
            if sp.sampling is None:
                raise ContractError(f"seq {sp.seq_id}: first plan without sampling parameters")
            seq = self.seqs[sp.seq_id] = _Seq(sp.sampling)
            self._verify_prefix(sp.seq_id, sp.new_blocks, sp.start_pos)
        for bid in sp.new_blocks:
            seq.table.append(bid)
            self.users.setdefault(bid, set()).add(sp.seq_id)
        if seq.finished:
            return None  # a plan sent ahead of the sequence's finish: skipped, like the executor does
        if not sp.token_ids and seq.last < 0:
            raise ContractError(f"seq {sp.seq_id}: decode without tokens before any sample")
        tokens = sp.token_ids or [seq.last]
        if sp.start_pos != seq.computed and seq.computed:
            raise ContractError(f"seq {sp.seq_id}: fed at {sp.start_pos}, KV ends at {seq.computed}")
        for i, tok in enumerate(tokens):
            self._write(sp.seq_id, seq, sp.start_pos + i, tok)
        seq.computed = sp.start_pos + len(tokens)
        if not sp.sample:
            return None
        token = self._sample(sp.seq_id, seq.computed)
        seq.last, seq.generated = token, seq.generated + 1
        finish = finish_reason(token, seq.generated, seq.sampling, (EOS,))
        seq.finished = finish is not Finish.NONE
        return SeqResult(seq_id=sp.seq_id, token_id=token, finish=finish)

    def _write(self, seq_id: int, seq: _Seq, pos: int, tok: int) -> None:
        idx = pos // self.bs
        if idx >= len(seq.table):
            raise ContractError(f"seq {seq_id}: position {pos} beyond its {len(seq.table)} blocks")
        bid = seq.table[idx]
        if self.users[bid] != {seq_id}:
            raise ContractError(f"seq {seq_id} writes block {bid} shared with {self.users[bid] - {seq_id}}")
        self.kv[bid * self.bs + pos % self.bs] = tok

    def _verify_prefix(self, seq_id: int, table: list[int], start: int) -> None:
        truth = self.oracle(seq_id) if self.oracle else None
        if truth is None:
            return
        if len(table) * self.bs < start:
            raise ContractError(f"seq {seq_id}: starts at {start} with only {len(table)} blocks")
        got = [self.kv[table[p // self.bs] * self.bs + p % self.bs] for p in range(start)]
        if got != truth[:start]:
            bad = next(i for i, (x, y) in enumerate(zip(got, truth, strict=False)) if x != y)
            raise ContractError(f"seq {seq_id}: cached KV differs from its tokens at position {bad}")

    @staticmethod
    def _sample(seq_id: int, pos: int) -> int:
        return 10 + (seq_id * 7919 + pos * 104729) % 30000
