"""In-process offline generation on token ids: no rings, no scheduler process.

The text side (tokenisation, detokenisation, stop strings) is the orchestrator's; offline generation
composes both in ``agentserve.cli.offline.LLM``, which hands this engine one :class:`OutputWatcher` per
sequence.  Each step is either one ragged prefill (the next chunk of every sequence still reading its prompt,
up to a token budget) or one batched decode of every sequence that has finished its prompt.  KV
blocks are reserved per sequence up front (prompt + max_tokens, capped at the context) from a simple
free list; sequences wait for room when the cache is full, so nothing is ever preempted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from agentserve.executor.builtin import resolve_model
from agentserve.executor.errors import EngineError, InvalidRequestError, PromptTooLongError
from agentserve.executor.runner import DecodeItem, ModelRunner, PrefillChunk
from agentserve.executor.sampler import Sampler, make_generator
from agentserve.protocol.sampling import Finish, SamplingParams
from agentserve.protocol.stopping import finish_reason

MIN_PREFILL_BUDGET = 4096  # tokens per prefill step (at least one chunk)


class OutputWatcher(Protocol):
    """Watches one sequence's tokens as they are sampled (the text layer: detokenizer + stop strings)."""

    def feed(self, token_id: int) -> bool:
        """A token was sampled; True when a stop string completed (the sequence stops now)."""
        ...

    def close(self) -> bool:
        """The sequence stopped for another reason; True when the held-back text held a stop string."""
        ...


class NoWatcher:
    """Token ids only: nothing stops a sequence but the token-level rules."""

    def feed(self, token_id: int) -> bool:
        return False

    def close(self) -> bool:
        return False


@dataclass
class EngineOutput:
    token_ids: list[int]
    finish_reason: str  # "stop" (eos, stop token or a watcher's stop) | "length"
    logprobs: list[float]


@dataclass
class _Seq:
    index: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    watcher: OutputWatcher
    blocks: list[int] = field(default_factory=list)
    cached: int = 0  # tokens whose K/V are in the cache
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: Finish = Finish.NONE

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out

    @property
    def prefilling(self) -> bool:
        return self.cached < len(self.prompt)


class OfflineEngine:
    """Load a model once, then :meth:`generate` for batches of token-id prompts."""

    def __init__(self, model: str | Path, *, cache_dir: str | None = None, max_batch_size: int = 64,
                 extra_eos_token_ids: list[int] | None = None, **runner_kwargs) -> None:
        self.path = resolve_model(str(model), cache_dir)
        self.runner = ModelRunner(self.path, **runner_kwargs)
        self.sampler = Sampler()
        self.max_batch_size = max_batch_size
        self.eos_token_ids = set(self.runner.config.eos_token_ids) | set(extra_eos_token_ids or [])

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    def generate(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams] | SamplingParams,
        watchers: list[OutputWatcher] | None = None,
        chunk_size: int = 512,
    ) -> list[EngineOutput]:
        """Generate for every prompt; outputs in prompt order. Raises an :class:`EngineError` on bad input."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        watchers = watchers if watchers is not None else [NoWatcher() for _ in prompts]
        self._validate(prompts, params, watchers, chunk_size)
        seqs = [self._new_seq(i, p, sp, w) for i, (p, sp, w) in enumerate(zip(prompts, params, watchers, strict=True))]
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
        return [EngineOutput(s.out, s.finish.name.lower(), s.logprobs) for s in seqs]

    def _validate(self, prompts: list[list[int]], params: list[SamplingParams], watchers: list[OutputWatcher],
                  chunk_size: int) -> None:
        if not len(prompts) == len(params) == len(watchers):
            raise InvalidRequestError(
                f"{len(prompts)} prompts but {len(params)} sampling params, {len(watchers)} watchers"
            )
        if chunk_size <= 0:
            raise InvalidRequestError(f"chunk size must be > 0, got {chunk_size}")
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

    def _new_seq(self, i: int, prompt: list[int], sp: SamplingParams, watcher: OutputWatcher) -> _Seq:
        gen = make_generator(sp.seed, self.runner.device if self.runner.device.type == "cuda" else "cpu")
        return _Seq(i, list(prompt), sp, gen, watcher)

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
            if s.watcher.feed(token) or (s.finish != Finish.NONE and s.watcher.close()):
                s.finish = Finish.STOP
