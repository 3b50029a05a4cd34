"""Grammar masks where tokens are sampled: each constrained sequence's llguidance matcher, advanced by
the executor with every token it samples.

Because the executor advances the matcher itself, a decode plan sent ahead (the decode lane's
look-ahead: "feed the token you sampled last") needs nothing from the orchestrator: the mask of step
N+1 already knows step N's token.  The orchestrator compiled and checked the grammar text; here it
is only instantiated against the checkpoint's ``tokenizer.json``.  llguidance is imported on first use, so
an executor that never sees a grammar runs without it (the offline device image has none).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from agentserve.executor.errors import InvalidRequestError

if TYPE_CHECKING:
    import llguidance


class GrammarMasks:
    def __init__(self, tokenizer_json: str | Path, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer_json = Path(tokenizer_json)
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on the first constrained sequence
        self._lock = threading.Lock()  # both lane threads may admit a constrained sequence first

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        import llguidance

        with self._lock:
            if self._tokenizer is None:
                text = self.tokenizer_json.read_text(encoding="utf-8")
                self._tokenizer = llguidance.LLTokenizer(text, n_vocab=self.vocab_size,
                                                         eos_token=self.eos_token_ids or None)
            return self._tokenizer

    def matcher(self, grammar: str, seen: Sequence[int] = ()) -> llguidance.LLMatcher:
        """A matcher for ``grammar`` that has already consumed ``seen`` (output before a recompute)."""
        import llguidance

        m = llguidance.LLMatcher(self._ll_tokenizer(), grammar, log_level=0)
        if m.is_error() or (seen and not m.consume_tokens(list(seen))):
            raise InvalidRequestError(f"grammar rejected: {m.get_error()}")
        return m


def mask_logits(logits: torch.Tensor, matchers: Sequence[llguidance.LLMatcher | None]) -> None:
    """Set the logits of tokens each row's grammar forbids to -inf, in place (rows without a matcher,
    or whose matcher allows nothing, are left as they are)."""
    rows = [i for i, m in enumerate(matchers) if m is not None and not m.is_error()]
    if not rows:
        return
    vocab = logits.shape[1]
    import llguidance.numpy as llnp

    bitmask = llnp.allocate_token_bitmask(len(rows), vocab)
    for j, i in enumerate(rows):
        llnp.fill_next_token_bitmask(matchers[i], bitmask, j)
    words = torch.from_numpy(bitmask).to(logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().reshape(len(rows), -1)[:, :vocab]
    index = torch.tensor(rows, device=logits.device)
    some = allowed.any(dim=1)
    masked = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))
    keep = torch.where(some.unsqueeze(1), masked, logits.index_select(0, index))
    logits.index_copy_(0, index, keep)


def advance(matcher: llguidance.LLMatcher, token: int) -> bool:
    """Feed the sampled ``token``; True when the grammar is complete (or broken): the sequence ends."""
    ok = matcher.consume_token(token)
    return not ok or matcher.is_stopped()


__all__ = ["GrammarMasks", "advance", "mask_logits"]
