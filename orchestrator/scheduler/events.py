"""What the scheduler tells the ingress about each request after a step."""

from __future__ import annotations

import msgspec

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

    @property
    def finished(self) -> bool:
        return self.finish is not Finish.NONE
