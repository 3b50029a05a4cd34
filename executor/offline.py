"""In-process offline generation (like vLLM's ``LLM``): no rings, no scheduler process.

Each step is either one ragged prefill (the next chunk of every sequence still reading its prompt,
up to a token budget) or one batched decode of every sequence that has finished its prompt.  KV
blocks are reserved per sequence up front (prompt + max_tokens, capped at the context) from a simple
free list; sequences wait for room when the cache is full, so nothing is ever preempted.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from agentserve.executor.builtin import resolve_model
from agentserve.executor.errors import EngineError, InvalidRequestError, PromptTooLongError
from agentserve.executor.runner import DecodeItem, ModelRunner, PrefillChunk
from agentserve.executor.sampler import Sampler, make_generator
from agentserve.orchestrator.detokenizer import IncrementalDetokenizer
from agentserve.orchestrator.stop_strings import StopStringMatcher
from agentserve.orchestrator.tokenization import Tokenizer
from agentserve.shm.messages import Finish, SamplingParams
from agentserve.shm.stopping import finish_reason

log = logging.getLogger(__name__)

MIN_PREFILL_BUDGET = 4096  # tokens per prefill step (at least one chunk)


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


@dataclass
class _Seq:
    index: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    detok: IncrementalDetokenizer
    matcher: StopStringMatcher
    blocks: list[int] = field(default_factory=list)
    cached: int = 0  # tokens whose K/V are in the cache
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish: Finish = Finish.NONE

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out

    @property
    def prefilling(self) -> bool:
        return self.cached < len(self.prompt)


class LLM:
    """Load a model once, then :meth:`generate` for batches of token-id prompts."""

    def __init__(self, model: str | Path, *, cache_dir: str | None = None, max_batch_size: int = 64,
                 **runner_kwargs) -> None:
        path = resolve_model(str(model), cache_dir)
        self.runner = ModelRunner(path, **runner_kwargs)
        self.tokenizer = load_tokenizer(path)
        self.sampler = Sampler()
        self.max_batch_size = max_batch_size
        eos = list(self.runner.config.eos_token_ids)
        self.eos_token_ids = set(eos + (self.tokenizer.eos_token_ids if self.tokenizer else []))

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    def generate(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams] | SamplingParams,
        stop: list[list[str]] | None = None,
        chunk_size: int = 512,
    ) -> list[GenerationOutput]:
        """Generate for every prompt; outputs in prompt order. Raises an :class:`EngineError` on bad input."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        stop = stop if stop is not None else [[] for _ in prompts]
        self._validate(prompts, params, stop, chunk_size)
        seqs = [self._new_seq(i, p, sp, st) for i, (p, sp, st) in enumerate(zip(prompts, params, stop, strict=True))]
        waiting, running = deque(seqs), []
        free = list(range(self.runner.num_blocks - 1, -1, -1))
        while waiting or running:
            self._admit(waiting, running, free)
            if any(s.prefilling for s in running):
                self._prefill_step([s for s in running if s.prefilling], chunk_size)
            else:
                self._decode_step(running)
            for s in [s for s in running if s.finish != Finish.NONE]:
                running.remove(s)
                free.extend(reversed(s.blocks))
        return [GenerationOutput(s.out, s.text, s.finish.name.lower(), s.logprobs) for s in seqs]

    def _validate(self, prompts: list[list[int]], params: list[SamplingParams], stop: list[list[str]],
                  chunk_size: int) -> None:
        if not len(prompts) == len(params) == len(stop):
            raise InvalidRequestError(f"{len(prompts)} prompts but {len(params)} sampling params, {len(stop)} stops")
        if chunk_size <= 0:
            raise InvalidRequestError(f"chunk size must be > 0, got {chunk_size}")
        if self.tokenizer is None and any(stop):
            raise InvalidRequestError("stop strings need a tokenizer; this checkpoint has no tokenizer.json")
        vocab = self.runner.config.vocab_size
        for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
            try:
                sp.validate()
            except ValueError as e:
                raise InvalidRequestError(f"prompt {i}: {e}") from None
            if not prompt:
                raise InvalidRequestError(f"prompt {i} is empty")
            if len(prompt) > self.max_model_len:
                raise PromptTooLongError(
                    f"prompt {i} has {len(prompt)} tokens; the model's context is {self.max_model_len}"
                )
            if min(prompt) < 0 or max(prompt) >= vocab:
                raise InvalidRequestError(f"prompt {i} has a token id outside the vocabulary [0, {vocab})")
            if self._blocks_needed(len(prompt), sp) > self.runner.num_blocks:
                raise EngineError(f"prompt {i} needs more KV blocks than the cache has ({self.runner.num_blocks})")

    def _blocks_needed(self, prompt_len: int, sp: SamplingParams) -> int:
        tokens = min(prompt_len + sp.max_tokens, self.max_model_len)
        return -(-tokens // self.runner.block_size)

    def _new_seq(self, i: int, prompt: list[int], sp: SamplingParams, stop: list[str]) -> _Seq:
        gen = make_generator(sp.seed, self.runner.device if self.runner.device.type == "cuda" else "cpu")
        detok = self.tokenizer.detokenizer() if self.tokenizer else IncrementalDetokenizer(_no_text)
        return _Seq(i, list(prompt), sp, gen, detok, StopStringMatcher(stop))

    def _admit(self, waiting: deque[_Seq], running: list[_Seq], free: list[int]) -> None:
        while waiting and len(running) < self.max_batch_size:
            need = self._blocks_needed(len(waiting[0].prompt), waiting[0].params)
            if need > len(free):
                break
            seq = waiting.popleft()
            seq.blocks = [free.pop() for _ in range(need)]
            running.append(seq)

    def _prefill_step(self, seqs: list[_Seq], chunk_size: int) -> None:
        budget = max(chunk_size, MIN_PREFILL_BUDGET)
        batch: list[_Seq] = []
        chunks: list[PrefillChunk] = []
        for s in seqs:
            n = min(chunk_size, len(s.prompt) - s.cached)
            if batch and n > budget:
                break
            chunks.append(PrefillChunk(s.prompt[s.cached:s.cached + n], s.cached, s.blocks))
            batch.append(s)
            budget -= n
        logits = self.runner.prefill(chunks)
        for s, c in zip(batch, chunks, strict=True):
            s.cached += len(c.token_ids)
        done = [i for i, s in enumerate(batch) if not s.prefilling]
        if done:
            self._sample(logits[done], [batch[i] for i in done])

    def _decode_step(self, seqs: list[_Seq]) -> None:
        items = [DecodeItem(s.out[-1], len(s.tokens) - 1, s.blocks) for s in seqs]
        logits = self.runner.decode(items)
        for s in seqs:
            s.cached += 1
        self._sample(logits, seqs)

    def _sample(self, logits: torch.Tensor, seqs: list[_Seq]) -> None:
        tokens, logprobs = self.sampler.sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
        for s, token, logprob in zip(seqs, tokens, logprobs, strict=True):
            s.out.append(token)
            s.logprobs.append(logprob)
            s.finish = finish_reason(token, len(s.out), s.params, self.eos_token_ids,
                                     len(s.tokens), self.max_model_len)
            self._emit_text(s, s.detok.add(token))
            if s.finish != Finish.NONE and not s.matcher.stopped:
                self._emit_text(s, s.detok.flush())
                s.text += s.matcher.flush()
                if s.matcher.stopped:  # the held-back text held a stop string
                    s.finish = Finish.STOP

    @staticmethod
    def _emit_text(s: _Seq, delta: str) -> None:
        if s.matcher.stopped:
            return
        m = s.matcher.feed(delta)
        s.text += m.text
        if m.stopped:
            s.finish = Finish.STOP
