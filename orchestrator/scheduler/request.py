"""A request: one LLM call (one agent turn) of a session, with its scheduling state.

States: ``WAITING`` (queued, holds no blocks) → ``PREFILL`` (admitted: holds blocks for its whole
prompt, feeds it in chunks) → ``DECODE`` (one token per step) → ``FINISHED``.  Preemption moves a
``PREFILL`` or ``DECODE`` request back to ``WAITING`` with its blocks released; it is prefilled
again later (recompute), generated tokens included.

The class (phase) of a prefill is decided from what is cached: more uncached tokens than the
configured threshold makes it ``COLD``, otherwise ``RESUME``.  Token positions: ``tokens`` is the
whole sequence (conversation + this turn's input + generated tokens); KV exists for
``tokens[:num_computed]``; the last sampled token is always fed by the next decode step.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from agentserve.protocol.sampling import Finish, SamplingParams

if TYPE_CHECKING:
    from agentserve.orchestrator.scheduler.session_kv import SessionKV


class ReqState(enum.IntEnum):
    WAITING = 0
    PREFILL = 1
    DECODE = 2
    FINISHED = 3


class Phase(enum.IntEnum):
    COLD = 0
    RESUME = 1
    DECODE = 2


class Request:
    __slots__ = (
        "seq_id", "session", "tokens", "num_prompt", "sampling", "priority", "arrival", "state", "phase",
        "num_computed", "block_table", "hashes", "keys", "hit_cache", "deferred_on", "num_sealed",
        "num_ready", "blocks_sent", "sampling_sent", "inflight", "ahead", "had_kv",
        "num_output", "first_token_t", "last_token_t", "queued_since", "first_service_t", "finish",
        "abort_pending", "failure", "end_tool", "num_cached", "preemptions", "num_uncached_at_class",
    )  # fmt: skip

    def __init__(
        self,
        seq_id: int,
        session: SessionKV,
        tokens: list[int],
        sampling: SamplingParams,
        priority: int,
        arrival: float,
    ) -> None:
        self.seq_id = seq_id
        self.session = session
        self.tokens = tokens
        self.num_prompt = len(tokens)
        self.sampling = sampling
        self.priority = priority
        self.arrival = arrival
        self.state = ReqState.WAITING
        self.phase = Phase.COLD
        self.num_uncached_at_class = len(tokens)  # prompt tokens not cached when its phase was last decided
        self.num_computed = 0
        self.block_table: list[int] = []
        self.hashes: list[int] = []  # chained hash of each full block of ``tokens`` (a cache)
        self.keys: list[tuple[int, ...]] = []  # the token ids of each full block (a cache)
        self.hit_cache: list[tuple[int, int]] = []  # the last prefix walk: (block, epoch) pairs
        self.deferred_on: tuple[int, int] | None = None  # (block, epoch) an admission waits for
        self.num_sealed = 0  # leading blocks of ``block_table`` that are sealed
        self.num_ready = 0  # leading blocks known to be computed
        self.blocks_sent = 0  # block-table entries the executor has
        self.sampling_sent = False
        self.inflight = 0  # plans in flight that hold this request
        self.ahead = 0  # decode tokens in flight (fed, not yet confirmed): the overlap lookahead
        self.had_kv = False  # finished after its prompt was computed (its table is worth retaining)
        self.num_output = 0
        self.first_token_t: float | None = None
        self.last_token_t = 0.0
        self.queued_since = arrival
        self.first_service_t: float | None = None
        self.finish = Finish.NONE
        self.abort_pending = False  # to finish once its plans in flight are back
        self.failure = ""  # the first failure it met: it finishes with ERROR (else an abort is ABORT)
        self.end_tool: bool | None = None  # end_turn() came while in flight: its in_tool_call
        self.num_cached = 0  # prompt tokens found cached at the last admission
        self.preemptions = 0

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_uncached(self) -> int:
        return len(self.tokens) - self.num_computed

    @property
    def remaining_tokens(self) -> int:
        """Output tokens this request may still produce."""
        return self.sampling.max_tokens - self.num_output

    @property
    def done(self) -> bool:
        return self.state is ReqState.FINISHED

    def __repr__(self) -> str:
        return (
            f"Request({self.seq_id}, {self.state.name}, {self.phase.name}, "
            f"computed={self.num_computed}/{len(self.tokens)}, out={self.num_output})"
        )
