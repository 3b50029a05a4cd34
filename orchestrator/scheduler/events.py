"""What the scheduler tells the ingress about each request after a step."""

from __future__ import annotations

import msgspec

from agentserve.protocol.ring_messages import SeqResult
from agentserve.protocol.sampling import Finish


class SeqEvent(msgspec.Struct, frozen=True, gc=False):
    """A new token for ``seq_id`` (``token_id`` -1: none, e.g. an abort) and/or its end.

    ``first`` marks the request's first token (its TTFT is ``t - arrival``); ``finish`` is
    ``Finish.NONE`` while the request runs, else why it stopped.
    """

    seq_id: int
    session_id: str
    token_id: int
    finish: Finish
    first: bool
    num_output: int
    t: float
    logprob: float = 0.0
    top_ids: list[int] = []  # the most likely tokens at this position, when the request asked for them
    top_logprobs: list[float] = []

    @classmethod
    def of(
        cls, seq_id: int, session_id: str, sr: SeqResult | None, finish: Finish, first: bool, num_output: int,
        t: float,
    ) -> SeqEvent:
        """The event for ``sr``'s token (``sr`` None: no token, e.g. an abort)."""
        if sr is None:
            return cls(seq_id, session_id, -1, finish, first, num_output, t)
        return cls(seq_id, session_id, sr.token_id, finish, first, num_output, t, sr.logprob, sr.top_ids,
                   sr.top_logprobs)

    @property
    def finished(self) -> bool:
        return self.finish is not Finish.NONE
