"""Token logprobs as OpenAI shapes them: chat's ``logprobs.content`` and the legacy completions object.

The orchestrator sends each token's logprob (and, when asked, its most likely alternatives) with the
token; a :class:`LogprobLog` keeps them in order and renders, for a stream chunk, the tokens not sent yet that
start in the text sent so far, or, for a whole answer, those that start in the returned text.  A token's text
is the checkpoint tokenizer's decoding of that one id (special tokens kept) — a token that is part of one
character decodes to U+FFFD, as in vLLM — and its ``bytes`` are the token's own raw bytes, so a client joins
split characters back together.  A token starts (a legacy ``text_offset``) where the text of the tokens before
it ends, as the orchestrator detokenizes the output (special tokens skipped, a partial character held back
until it is whole, so the tokens of one character share its offset; bytes that never make a character are the
U+FFFD the text shows for them, and the token after them starts past it); a token that starts in text a stop
string cut off is listed by neither endpoint (vLLM lists it, past the text's end; llama.cpp drops it).  A logprob
of ``-inf`` (a token the grammar ruled out) is written as -9999.0, OpenAI's stand-in: JSON has no infinity.
"""

from __future__ import annotations

import os
from bisect import bisect_left
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from agentserve.client import TokenIds
from agentserve.gateway.errors import bad_request
from agentserve.orchestrator.text.detokenizer import REPLACEMENT
from agentserve.orchestrator.text.tokenization import IncrementalDetokenizer, Tokenizer
from agentserve.protocol.sampling import MAX_TOP_LOGPROBS

FLOOR = -9999.0

Alternatives = list[tuple[int, float]]


def finite(logprob: float) -> float:
    """``logprob``, or :data:`FLOOR` for -inf, NaN and anything below it."""
    return logprob if logprob > FLOOR else FLOOR


def chat_options(logprobs: bool | int | None, top_logprobs: int | None) -> dict[str, Any]:
    """The turn options for chat's ``logprobs`` / ``top_logprobs`` (400 for values OpenAI refuses)."""
    if logprobs is not None and not isinstance(logprobs, bool):
        raise bad_request("logprobs must be a boolean on /v1/chat/completions", param="logprobs")
    if top_logprobs is not None and not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param="top_logprobs")
    if top_logprobs and not logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    return {"logprobs": True, "top_logprobs": top_logprobs or 0} if logprobs else {}


def completion_options(logprobs: bool | int | None) -> dict[str, Any]:
    """The turn options for the legacy ``logprobs`` (an int: alternatives per token, 0 for none)."""
    if logprobs is None or logprobs is False:
        return {}
    if isinstance(logprobs, bool) or not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"logprobs must be an integer between 0 and {MAX_TOP_LOGPROBS}", param="logprobs")
    return {"logprobs": True, "top_logprobs": logprobs}


@dataclass
class LogprobLog:
    """One choice's token logprobs in order, and how many of them a stream has sent."""

    tokenizer: Tokenizer
    tokens: list[tuple[int, float, Alternatives]] = field(default_factory=list)
    sent: int = 0
    _texts: dict[int, str] = field(default_factory=dict)
    _bytes: dict[int, list[int]] = field(default_factory=dict)
    _offsets: list[int] = field(default_factory=list)  # where each token's text starts in the output
    _chars: int = 0  # the length of the text the detokenizer released for the tokens counted in _offsets
    _detok: IncrementalDetokenizer | None = None
    _window: int = 0  # the detokenizer's decode window starts at this token...
    _held: int = 0  # ...and the tokens from this one on are held back (their text is not released yet)

    def add(self, event: TokenIds) -> None:
        for i, (token, logprob) in enumerate(zip(event.token_ids, event.logprobs, strict=False)):
            tops = event.top_logprobs[i] if i < len(event.top_logprobs) else []
            self.tokens.append((token, logprob, tops))

    def take(self, chars: int, final: bool) -> tuple[int, list[tuple[int, float, Alternatives]]]:
        """The index of the first token not sent yet, and the tokens from it whose text starts within the first
        ``chars`` characters of the returned text, now counted as sent.  ``final``: the text is whole, ``chars``
        long; then the tokens at its end (an eos) are taken too, unless a stop string cut the text short: the
        tokens that start in the cut text are never taken, so every token starts within the returned text."""
        offsets = self._offsets_to(len(self.tokens), final)
        uncut = final and self._chars <= chars
        end = len(self.tokens) if uncut else bisect_left(offsets, chars, lo=self.sent)
        start, self.sent = self.sent, end
        return start, self.tokens[start:end]

    def text(self, token: int) -> str:
        if token not in self._texts:
            self._texts[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return self._texts[token]

    def _raw(self, token: int) -> list[int]:
        if token not in self._bytes:
            self._bytes[token] = list(self.tokenizer.token_bytes(token))
        return self._bytes[token]

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        return {"token": self.text(token), "logprob": finite(logprob), "bytes": self._raw(token)}

    def _offsets_to(self, end: int, final: bool = False) -> list[int]:
        """The text offsets of the first ``end`` tokens, extended from those already known (each token is
        detokenized once: the detokenizer decodes a window of a few tokens, never the whole output).  ``final``
        (all tokens are in): the held-back bytes are released as U+FFFD, as the orchestrator ends the text."""
        if self._detok is None:  # made on first use: the orchestrator's detokenization
            self._detok = self.tokenizer.detokenizer(skip_special_tokens=True)
        for token, _, _ in self.tokens[len(self._offsets):end]:
            self._offsets.append(self._chars)  # held back: where the text released so far ends, for now
            self._released(self._detok.add(token))
        if final and end == len(self.tokens):
            self._released(self._detok.flush())
        return self._offsets

    def _released(self, delta: str) -> None:
        """Counts ``delta``, the text the detokenizer released for the held-back tokens and the last one, and
        places those after the first within it (a held token starts where the released text ended only while its
        character may still be whole: bytes that turn out invalid are a U+FFFD in the text, and what follows
        them starts past it)."""
        if not delta:
            return
        if len(self._offsets) - self._held > 1:  # tokens were held back (else the one token starts at _chars)
            ids = [t for t, _, _ in self.tokens[self._window:len(self._offsets)]]
            held = self._held - self._window
            before = len(self.tokenizer.decode(ids[:held]))  # the window's text that was released before
            texts = [self.tokenizer.decode(ids[:k])[before:] for k in range(held + 1, len(ids) + 1)]
            for i, (text, after) in enumerate(pairwise(texts), start=held + 1):
                self._offsets[self._window + i] = self._chars + self._start(ids[i], text, after, delta)
        self._window, self._held = self._held, len(self._offsets)
        self._chars += len(delta)

    def _start(self, token: int, text: str, after: str, delta: str) -> int:
        """Where a held-back ``token`` starts in ``delta``: ``text`` and ``after`` are what the held tokens before
        it decode to, without it and with it.  It starts where that text stops matching the released one (a partial
        character's U+FFFD became a character), but within the U+FFFD of invalid bytes its own bytes join (adding no
        character)."""
        start = len(os.path.commonprefix([text, delta]))
        joins = start == len(text) and text.endswith(REPLACEMENT) and len(after) == len(text)
        return start - 1 if joins and self.tokenizer.decode([token]) else start

    def chat(self, tokens: list[tuple[int, float, Alternatives]]) -> dict[str, Any]:
        """Chat's ``logprobs`` object for ``tokens``."""
        content = [self._entry(t, lp) | {"top_logprobs": [self._entry(a, alp) for a, alp in tops]}
                   for t, lp, tops in tokens]
        return {"content": content, "refusal": None}

    def take_chat(self, chars: int, final: bool) -> dict[str, Any]:
        """Chat's ``logprobs`` object of the tokens :meth:`take` takes."""
        return self.chat(self.take(chars, final)[1])

    def take_legacy(self, chars: int, final: bool) -> dict[str, Any]:
        """The completions ``logprobs`` object of the tokens :meth:`take` takes: every offset indexes the
        returned text."""
        return self.legacy(*self.take(chars, final))

    def legacy(self, start: int, tokens: list[tuple[int, float, Alternatives]]) -> dict[str, Any]:
        """The completions ``logprobs`` object for ``tokens``, the output's tokens from index ``start``."""
        texts = [self.text(t) for t, _, _ in tokens]
        offsets = self._offsets_to(start + len(tokens))[start:start + len(tokens)]
        tops = [{self.text(a): finite(alp) for a, alp in alts} for _, _, alts in tokens]
        return {"tokens": texts, "token_logprobs": [finite(lp) for _, lp, _ in tokens],
                "top_logprobs": tops, "text_offset": offsets}
