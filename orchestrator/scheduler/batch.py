"""One lane step under construction: the policy adds requests, the batch turns them into SeqPlans.

The policy decides *what* runs (which requests, how many tokens); the batch asks its host (the
scheduler) for the blocks — admission, growth, preemption — and writes the wire form: only the
block-table entries the executor does not have yet, and the sampling parameters once per
(re)admission.
"""

from __future__ import annotations

from typing import Protocol

from agentserve.orchestrator.scheduler.request import Phase, ReqState, Request
from agentserve.protocol.lanes import Lane
from agentserve.protocol.ring_messages import SeqPlan
from agentserve.protocol.sampling import MAX_GRAMMAR_BYTES, SamplingParams

# One sequence of a planned step, as the scheduler needs it when the step's result lands:
# (request, tokens fed (at least 1), the step samples a token for it, fed one decode token).
# A plain tuple: one is built per sequence per step, on the scheduler's hot path.
Entry = tuple[Request, int, bool, bool]


class BatchHost(Protocol):
    def admit(self, req: Request, batch: Batch) -> bool: ...

    def grow(self, req: Request, num_positions: int, batch: Batch) -> bool: ...

    def sampling_for(self, req: Request) -> SamplingParams: ...


class Batch:
    __slots__ = (
        "host", "lane", "max_seqs", "now", "block_size", "entries", "seqs", "in_batch", "num_decode",
        "num_prefill_tokens", "blocked", "grammar_bytes",
    )  # fmt: skip

    def __init__(self, host: BatchHost, lane: Lane, max_seqs: int, now: float, block_size: int) -> None:
        self.host, self.lane, self.max_seqs, self.now = host, lane, max_seqs, now
        self.block_size = block_size
        self.entries: list[Entry] = []
        self.seqs: list[SeqPlan] = []
        self.in_batch: set[int] = set()
        self.num_decode = 0
        self.num_prefill_tokens = 0
        self.blocked = False  # an admission failed for lack of blocks
        self.grammar_bytes = 0  # grammar text this step's plan carries (sent once per admission)

    @property
    def full(self) -> bool:
        return len(self.seqs) >= self.max_seqs

    @property
    def num_tokens(self) -> int:
        return self.num_decode + self.num_prefill_tokens

    def decode(self, req: Request) -> bool:
        """Add one decode token of ``req``; False if it cannot run this step."""
        if self.full or req.state is not ReqState.DECODE or req.seq_id in self.in_batch:
            return False
        ahead = req.ahead
        if req.inflight != ahead:  # in flight in a prefill step: wait for it; only decodes may run ahead
            return False
        tokens, table = req.tokens, req.block_table
        positions = len(tokens) + ahead  # position of the token fed, plus one
        if positions > len(table) * self.block_size and not self.host.grow(req, positions, self):
            return False
        self._add(req, [] if ahead else [tokens[-1]], True, True, req.num_computed + ahead)
        self.num_decode += 1
        return True

    def prefill(self, req: Request, max_tokens: int, phase: Phase | None = None) -> int:
        """Add up to ``max_tokens`` prompt tokens of ``req`` (admitting it); return how many."""
        if self.full or max_tokens <= 0 or req.inflight or req.seq_id in self.in_batch:
            return 0
        if self.grammar_bytes and self.grammar_bytes + _grammar_bytes(req) > MAX_GRAMMAR_BYTES:
            return 0  # its grammar goes in a later step's plan (one ring slot holds a plan); one always fits
        if req.state is ReqState.WAITING and not self.host.admit(req, self):
            return 0
        if req.state is not ReqState.PREFILL or (phase is not None and req.phase is not phase):
            return 0
        start = req.num_computed
        n = min(max_tokens, len(req.tokens) - start)
        self._add(req, req.tokens[start : start + n], start + n == len(req.tokens), False, start)
        self.num_prefill_tokens += n
        req.queued_since = self.now
        if req.first_service_t is None:
            req.first_service_t = self.now
        return n

    def _add(self, req: Request, token_ids: list[int], sample: bool, decode: bool, start: int) -> None:
        table = req.block_table
        new_blocks = table[req.blocks_sent :] if req.blocks_sent < len(table) else []
        req.blocks_sent = len(table)
        sampling = None
        if not req.sampling_sent:
            self.grammar_bytes += _grammar_bytes(req)
            sampling, req.sampling_sent = self.host.sampling_for(req), True
        self.seqs.append(SeqPlan(req.seq_id, token_ids, start, new_blocks, sample, sampling))
        self.entries.append((req, len(token_ids) or 1, sample, decode))
        self.in_batch.add(req.seq_id)


def _grammar_bytes(req: Request) -> int:
    """The grammar text ``req``'s next plan carries: its grammar and the output tokens it has already seen."""
    if req.sampling_sent or not req.sampling.grammar:
        return 0
    return len(req.sampling.grammar.encode()) + 5 * req.num_output
