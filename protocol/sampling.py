"""Per-request sampling parameters and why a sequence stopped: both processes and the client rely on them."""

from __future__ import annotations

import enum

from agentserve.protocol.base import WireStruct

MAX_TOP_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's bound)


# The most grammar text one plan carries, in UTF-8 bytes (a ring slot is 128 KiB): one constraint's grammar may be
# this large; a step starts further constrained sequences only while their grammars fit beside the first.
MAX_GRAMMAR_BYTES = 48 * 1024


class SamplingError(ValueError):
    """An invalid sampling value; ``param`` is its field, which is also the OpenAI request's name for it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class Finish(enum.IntEnum):
    """Why a sequence stopped producing tokens (``NONE`` while it runs)."""

    NONE = 0
    STOP = 1  # an eos or stop token id was sampled
    LENGTH = 2  # max_tokens reached
    ABORT = 3  # the orchestrator dropped it
    ERROR = 4  # a step computing it failed (the orchestrator's verdict; the executor never reports it)


class SamplingParams(WireStruct, frozen=True):
    """Per-request sampling. ``temperature == 0`` is greedy; 0 / 1.0 disable top_k / top_p."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    grammar: str = ""  # llguidance grammar constraining the output ("" = none); masks applied where sampled
    grammar_prefix: list[int] = []  # output tokens the grammar has already seen (a recomputed sequence)
    top_logprobs: int = 0  # the most likely tokens (with logprobs) returned beside each sampled one

    def validate(self) -> None:
        """Raise :class:`SamplingError` naming the first invalid field."""
        if not self.temperature >= 0.0:
            raise SamplingError("temperature", f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SamplingError("top_k", f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens <= 0:
            raise SamplingError("max_tokens", f"max_tokens must be > 0, got {self.max_tokens}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise SamplingError("top_logprobs",
                                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise SamplingError("seed", f"seed must be in [0, 2**63), got {self.seed}")
