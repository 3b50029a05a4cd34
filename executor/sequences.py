"""The executor's mirror of sequence state, keyed by ``seq_id``.

The orchestrator owns every sequence; the executor keeps only what a step needs: the block table,
the sampling parameters (sent once), the per-request generator, the last sampled token (so a decode
plan may omit it — the overlap rule of :mod:`agentserve.protocol.ring_messages`) and the generated count.

Invariant kept by the orchestrator: the plans of one sequence in flight at the same time are all on
one lane (a lane runs its plans in order; a decode plan may be queued behind the running one), and
``Release`` for it comes only after the results of all its plans are back.  So each entry is touched by
one lane thread at a time; the lock guards only the dictionary itself.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from agentserve.executor.errors import InvalidRequestError
from agentserve.executor.grammar import GrammarMasks
from agentserve.executor.sampler import make_generator
from agentserve.protocol.ring_messages import SeqPlan
from agentserve.protocol.sampling import Finish, SamplingParams


@dataclass
class SeqState:
    sampling: SamplingParams
    generator: torch.Generator | None
    block_table: list[int] = field(default_factory=list)
    last_token: int = -1
    num_generated: int = 0
    finish: Finish = Finish.NONE
    matcher: Any = None  # the llguidance matcher of a constrained sequence, advanced with each sample

    def tokens_for(self, plan: SeqPlan) -> list[int]:
        """The tokens this step feeds: the plan's, or the last sampled one (decode overlap)."""
        if plan.token_ids:
            return plan.token_ids
        if self.last_token < 0:
            raise InvalidRequestError(f"sequence {plan.seq_id}: decode without tokens before any sample")
        return [self.last_token]


class SequenceTable:
    def __init__(self, device: torch.device, grammars: GrammarMasks | None = None) -> None:
        self._device = device
        self.grammars = grammars
        self._seqs: dict[int, SeqState] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seqs)

    def admit(self, plan: SeqPlan) -> SeqState:
        """The state for ``plan.seq_id``, created on its first plan, with ``new_blocks`` appended."""
        with self._lock:
            state = self._seqs.get(plan.seq_id)
            if state is None:
                if plan.sampling is None:
                    raise InvalidRequestError(f"sequence {plan.seq_id}: first plan has no sampling params")
                gen_device = self._device if self._device.type == "cuda" else "cpu"
                state = SeqState(plan.sampling, make_generator(plan.sampling.seed, gen_device))
                state.matcher = self._matcher(plan)
                self._seqs[plan.seq_id] = state
        state.block_table.extend(plan.new_blocks)
        return state

    def _matcher(self, plan: SeqPlan) -> Any:
        sampling = plan.sampling
        if sampling is None or not sampling.grammar:
            return None
        if self.grammars is None:
            raise InvalidRequestError(f"sequence {plan.seq_id}: constrained output, but this executor has no grammars")
        return self.grammars.matcher(sampling.grammar, sampling.grammar_prefix)

    def release(self, seq_ids: list[int]) -> None:
        with self._lock:
            for seq_id in seq_ids:
                self._seqs.pop(seq_id, None)
