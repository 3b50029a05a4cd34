"""Baselines in the same engine, all on one lane on the full (unpartitioned) rung.

- ``fcfs``: vLLM-v0-like. Waiting prompts run first, each whole (FIFO, several per step while they
  fit ``max_batch_tokens``); decodes run only in steps with no prompt to start.
- ``chunked``: Sarathi / vLLM-v1-like. Decodes first, then prompt chunks FIFO up to a fixed token
  budget per step (the budget counts the decode tokens too).
- ``llamacpp``: llama.cpp server-like. ``n_slots`` requests at most are active; each step is one
  unified batch of ``n_batch`` tokens: every generating slot's token, then prompt pieces FIFO.
  No priority anywhere.
"""

from __future__ import annotations

from agentserve.orchestrator.policies.base import Policy
from agentserve.orchestrator.scheduler.batch import Batch
from agentserve.orchestrator.scheduler.queues import Queues
from agentserve.orchestrator.scheduler.request import ReqState
from agentserve.protocol.lanes import Lane

WHOLE = 1 << 30


def fifo_chunks(batch: Batch, q: Queues, left: int, max_active: int | None) -> None:
    """Prompt pieces FIFO until ``left`` tokens are used; new requests only while slots are free."""
    for req in q.fifo_order():
        if left <= 0 or batch.full:
            break
        if max_active is not None and req.state is ReqState.WAITING and q.num_active() >= max_active:
            break
        left -= batch.prefill(req, left)


class Fcfs(Policy):
    name = "fcfs"

    def fill(self, lane: Lane, batch: Batch, q: Queues, now: float, other_rung: int | None):
        budget = left = self.config.fcfs.max_batch_tokens
        for req in q.fifo_order():
            if batch.full or (batch.seqs and len(req.tokens) - req.num_computed > left):
                break
            n = batch.prefill(req, WHOLE)
            if n == 0:
                break  # strict FIFO: the head could not start, nothing overtakes it
            left -= n
        if batch.seqs:
            return budget, self.ladder.full
        self.decode_all(batch, q)
        return batch.num_decode, self.ladder.full


class Chunked(Policy):
    name = "chunked"

    def fill(self, lane: Lane, batch: Batch, q: Queues, now: float, other_rung: int | None):
        budget = self.config.chunked.token_budget
        self.decode_all(batch, q)
        fifo_chunks(batch, q, budget - batch.num_decode, max_active=None)
        return budget, self.ladder.full


class LlamaCpp(Policy):
    name = "llamacpp"

    def max_seqs(self, lane: Lane) -> int:
        return self.config.llamacpp.n_slots

    def fill(self, lane: Lane, batch: Batch, q: Queues, now: float, other_rung: int | None):
        budget = self.config.llamacpp.n_batch
        self.decode_all(batch, q)
        fifo_chunks(batch, q, budget - batch.num_decode, max_active=self.config.llamacpp.n_slots)
        return budget, self.ladder.full
