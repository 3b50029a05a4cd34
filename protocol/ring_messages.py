"""The messages that cross the shared-memory rings, and their codec.

Orchestrator → executor (decision ring): :class:`Plan`, :class:`Release`, :class:`Reconfigure`,
:class:`Shutdown`.  Executor → orchestrator (result ring): :class:`Ready`, :class:`Result`,
:class:`ExecError`.  Every message is a tagged ``msgspec.Struct`` encoded array-like, so the wire
form is a short msgpack array whose first element is the tag.

Sequence state lives on both sides: the orchestrator owns it, the executor mirrors the part it
needs (block table, sampling parameters, last sampled token, tokens generated) keyed by
``seq_id`` until a :class:`Release` drops it.  A ``seq_id`` names one request (one agent turn);
its block table may start with blocks shared with other sequences (prefix cache).

Overlap: a decode :class:`SeqPlan` with empty ``token_ids`` means "feed the token this sequence
sampled last", so the orchestrator can put step N+1 on the ring before step N's result is back.

This module must stay free of torch: the orchestrator imports it.
"""

from __future__ import annotations

import msgspec

from agentserve.protocol.base import WireStruct
from agentserve.protocol.lanes import Lane, Rung
from agentserve.protocol.sampling import Finish, SamplingParams

WIRE_VERSION = 2


class SeqPlan(WireStruct):
    """One sequence's share of a step.

    ``token_ids`` are fed at positions ``start_pos ..``; empty means the last sampled token
    (decode overlap).  ``new_blocks`` are appended to the executor's block table for this
    sequence (the whole table when the sequence is new).  ``sample`` is false for every prefill
    chunk but the last.  ``sampling`` is sent once, with the sequence's first plan.
    """

    seq_id: int
    token_ids: list[int]
    start_pos: int
    new_blocks: list[int] = []
    sample: bool = True
    sampling: SamplingParams | None = None


class Plan(WireStruct, tag="plan"):
    """One lane's work for one step: the decision the scheduler makes."""

    step: int
    lane: Lane
    rung: int  # context index: which partition rung the lane runs on
    token_budget: int
    seqs: list[SeqPlan]
    # on CPU cores, run inside the step the lane is running, at its next layer boundary (a resume sent ahead
    # of a cold chunk in flight): its Result then comes back before that step's; else in its turn
    preempt: bool = False
    # on CPU cores, a shared-rung prefill step (resumes only) that takes the decode lane's cores once the decode step
    # running ends and keeps them to its end, decode waiting: a resume on every core, as under fcfs
    hold_cores: bool = False
    # on CPU cores, a prefill step planned while no sequence decodes and no decode plan is in flight or sent with it: it
    # borrows the decode lane's cores from its start, not once decode has been idle for the pause that ends a burst
    decode_idle: bool = False


class Release(WireStruct, tag="release"):
    """Forget executor-side state of these sequences (finished, aborted or preempted)."""

    seq_ids: list[int]


class Reconfigure(WireStruct, tag="reconfigure"):
    """Change executor settings at a step boundary (``-1`` leaves a field as it is)."""

    decode_rung: int = -1


class Shutdown(WireStruct, tag="shutdown"):
    reason: str = ""


class Ready(WireStruct, tag="ready"):
    """The executor is loaded and serving."""

    wire_version: int
    pid: int
    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    backend: str
    reason: str
    ladder: list[Rung]
    device: str = ""
    model: str = ""


class SeqResult(WireStruct):
    """``token_id`` is -1 when the step did not sample this sequence (a non-final prefill chunk).

    ``top_ids`` / ``top_logprobs``: the sequence's ``SamplingParams.top_logprobs`` most likely tokens,
    most likely first (empty when it asked for none)."""

    seq_id: int
    token_id: int = -1
    logprob: float = 0.0
    finish: Finish = Finish.NONE
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class Result(WireStruct, tag="result"):
    """What one lane step produced. Times are ``time.monotonic()`` seconds of the executor."""

    step: int
    lane: Lane
    rung: int
    seqs: list[SeqResult]
    t_start: float
    t_end: float
    gap_ms: float = 0.0  # idle time of this lane before the step began
    gpu_ms: float = -1.0  # the step's GPU time between CUDA events on its stream (-1: not measured, e.g. CPU)


class ExecError(WireStruct, tag="error"):
    """The executor failed a step (``fatal``: it is going down)."""

    message: str
    step: int = -1
    seq_ids: list[int] = []
    fatal: bool = False


ToExecutor = Plan | Release | Reconfigure | Shutdown
FromExecutor = Ready | Result | ExecError


class DecodeError(ValueError):
    """A ring slot held bytes that are not a valid message."""


class Codec:
    """One reused encoder and decoder for one direction of the rings."""

    def __init__(self, union: object) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(union)

    def encode_into(self, msg: msgspec.Struct, buf: bytearray) -> int:
        """Encode ``msg`` into the reused ``buf`` (resized as needed); return the byte length."""
        self._encoder.encode_into(msg, buf)
        return len(buf)

    def encode(self, msg: msgspec.Struct) -> bytes:
        return self._encoder.encode(msg)

    def decode(self, data: bytes | memoryview) -> msgspec.Struct:
        try:
            return self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise DecodeError(f"undecodable message: {e}") from None


def to_executor_codec() -> Codec:
    return Codec(ToExecutor)


def from_executor_codec() -> Codec:
    return Codec(FromExecutor)
