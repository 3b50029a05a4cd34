"""Offline generation with text (like vLLM's ``LLM``): the orchestrator's text room composed with the engine.

The engine (``agentserve.executor.offline.OfflineEngine``) works on token ids; this module adds what the
orchestrator does for a served turn — the checkpoint's tokenizer, streaming detokenisation and stop
strings — through one :class:`TextWatcher` per sequence.  ``agentserve generate`` runs on it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from agentserve.executor.builtin import resolve_model
from agentserve.executor.errors import InvalidRequestError
from agentserve.executor.offline import OfflineEngine
from agentserve.orchestrator.text.detokenizer import IncrementalDetokenizer
from agentserve.orchestrator.text.stop_strings import StopStringMatcher
from agentserve.orchestrator.text.tokenization import Tokenizer
from agentserve.protocol.sampling import SamplingParams

log = logging.getLogger(__name__)


def load_tokenizer(path: Path) -> Tokenizer | None:
    """The checkpoint's tokenizer; ``None`` when it has none (token-id prompts still work, text is empty)."""
    if not (path / "tokenizer.json").is_file():
        log.warning("%s has no tokenizer.json: outputs will carry token ids but no text", path)
        return None
    return Tokenizer.from_dir(path)


def _no_text(ids: list[int], skip_special_tokens: bool = True) -> str:
    return ""


@dataclass
class GenerationOutput:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (eos, stop token or stop string) | "length"
    logprobs: list[float]


class TextWatcher:
    """One sequence's text: detokenised deltas through the stop-string matcher (text after a stop is cut)."""

    def __init__(self, detok: IncrementalDetokenizer, stop: list[str]) -> None:
        self.detok = detok
        self.matcher = StopStringMatcher(stop)
        self.text = ""

    def feed(self, token_id: int) -> bool:
        self._emit(self.detok.add(token_id))
        return self.matcher.stopped

    def close(self) -> bool:
        if self.matcher.stopped:
            return True
        self._emit(self.detok.flush())
        self.text += self.matcher.flush()
        return self.matcher.stopped

    def _emit(self, delta: str) -> None:
        if not self.matcher.stopped:
            self.text += self.matcher.feed(delta).text


class LLM:
    """Load a model once, then :meth:`generate` text for batches of token-id prompts."""

    def __init__(self, model: str | Path, *, cache_dir: str | None = None, max_batch_size: int = 64,
                 **runner_kwargs) -> None:
        path = resolve_model(str(model), cache_dir)
        self.tokenizer = load_tokenizer(path)
        extra_eos = self.tokenizer.eos_token_ids if self.tokenizer else []
        self.engine = OfflineEngine(path, max_batch_size=max_batch_size, extra_eos_token_ids=extra_eos,
                                    **runner_kwargs)
        self.runner = self.engine.runner

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def eos_token_ids(self) -> set[int]:
        """The token ids that end a sequence unless ``ignore_eos`` (the checkpoint's and the tokenizer's)."""
        return self.engine.eos_token_ids

    def generate(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams] | SamplingParams,
        stop: list[list[str]] | None = None,
        chunk_size: int = 512,
    ) -> list[GenerationOutput]:
        """Generate for every prompt; outputs in prompt order. Raises an ``EngineError`` on bad input."""
        stop = stop if stop is not None else [[] for _ in prompts]
        if len(stop) != len(prompts):
            raise InvalidRequestError(f"{len(prompts)} prompts but {len(stop)} stop lists")
        if self.tokenizer is None and any(stop):
            raise InvalidRequestError("stop strings need a tokenizer; this checkpoint has no tokenizer.json")
        watchers = [TextWatcher(self._detokenizer(), s) for s in stop]
        outs = self.engine.generate(prompts, params, watchers, chunk_size)
        return [GenerationOutput(o.token_ids, w.text, o.finish_reason, o.logprobs)
                for o, w in zip(outs, watchers, strict=True)]

    def _detokenizer(self) -> IncrementalDetokenizer:
        return self.tokenizer.detokenizer() if self.tokenizer else IncrementalDetokenizer(_no_text)
