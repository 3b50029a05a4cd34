"""Token sampling for a batch of logits rows, each with its own :class:`SamplingParams`.

Greedy rows take the argmax.  Sampled rows are scaled by temperature, filtered by top-k, top-p and
min-p (in that order), then drawn with the exponential-race trick: ``argmax(p / q)`` with
``q ~ Exp(1)`` is a draw from ``p``.  A seeded request draws its ``q`` from its own generator, one
full-vocabulary row per step, so its tokens depend only on its seed and its own logits — never on
which other requests share the batch.  The logprob is the log-softmax of the unmodified logits at
the chosen token; :meth:`Sampler.sample_with_top` also reads the most likely tokens from the same log-softmax.
"""

from __future__ import annotations

import torch

from agentserve.protocol.sampling import SamplingParams


def _col(values: list[float] | list[int], like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=like.device).unsqueeze(1)


def apply_top_k_top_p(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p nucleus to -inf (``0`` / ``1.0`` = off)."""
    vocab = x.shape[1]
    sorted_x, order = x.sort(dim=1, descending=True)
    rank = torch.arange(vocab, device=x.device).unsqueeze(0)
    k = _col([k if 0 < k < vocab else vocab for k in top_k], x, torch.long)
    sorted_x = sorted_x.masked_fill(rank >= k, float("-inf"))
    if any(p < 1.0 for p in top_p):
        probs = sorted_x.softmax(dim=1)
        before = probs.cumsum(dim=1) - probs  # mass of the strictly better tokens
        p = _col([p if p < 1.0 else 2.0 for p in top_p], x, torch.float32)
        sorted_x = sorted_x.masked_fill(before >= p, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, sorted_x)


def apply_min_p(x: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the top token's."""
    probs = x.softmax(dim=1)
    floor = _col(min_p, x, torch.float32) * probs.max(dim=1, keepdim=True).values
    return x.masked_fill(probs < floor, float("-inf"))


def _race_noise(shape: tuple[int, int], generators: list[torch.Generator | None], device) -> torch.Tensor:
    """``Exp(1)`` noise; seeded rows from their own generator, the rest from the global one."""
    q = torch.empty(shape, dtype=torch.float32, device=device).exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            q[i].exponential_(generator=g)
    return q.clamp_min_(1e-20)


class Sampler:
    """Stateless; one instance per executor."""

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> tuple[list[int], list[float]]:
        """``logits``: ``[n, vocab]`` fp32. Returns the chosen token ids and their logprobs."""
        tokens, logprobs, _ = self.sample_with_top(logits, params, generators)
        return tokens, logprobs

    def sample_with_top(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> tuple[list[int], list[float], list[tuple[list[int], list[float]]]]:
        """:meth:`sample`, plus each row's ``params[i].top_logprobs`` most likely tokens and their logprobs
        (most likely first; empty for a row that asks for none), read from the same log-softmax."""
        logits = logits.float()
        tokens = logits.argmax(dim=1)
        rows = [i for i, p in enumerate(params) if p.temperature > 0.0 and p.top_k != 1]
        if rows:
            tokens[rows] = self._draw(logits[rows], [params[i] for i in rows], [generators[i] for i in rows])
        logp = logits.log_softmax(dim=1)
        chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
        top_rows = [i for i, p in enumerate(params) if p.top_logprobs > 0]
        k = min(max((params[i].top_logprobs for i in top_rows), default=0), logits.shape[1])
        parts = [tokens, chosen]
        if k:
            values, ids = logp[top_rows].topk(k, dim=1, sorted=True)
            parts += [ids.flatten(), values.flatten()]
        # one device-to-host copy for everything (fp64 holds every token id and fp32 logprob exactly)
        host = torch.cat([t.to(torch.float64) for t in parts]).tolist()
        n = len(params)
        tops: list[tuple[list[int], list[float]]] = [([], []) for _ in params]
        for j, i in enumerate(top_rows):
            lo, m = 2 * n + j * k, min(params[i].top_logprobs, k)
            ids_j, values_j = host[lo:lo + m], host[lo + len(top_rows) * k:lo + len(top_rows) * k + m]
            tops[i] = ([int(t) for t in ids_j], values_j)
        return [int(t) for t in host[:n]], host[n:2 * n], tops

    def _draw(self, logits: torch.Tensor, params: list[SamplingParams], gens: list) -> torch.Tensor:
        x = logits / _col([p.temperature for p in params], logits, torch.float32)
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            x = apply_top_k_top_p(x, [p.top_k for p in params], [p.top_p for p in params])
        if any(p.min_p > 0.0 for p in params):
            x = apply_min_p(x, [p.min_p for p in params])
        probs = x.softmax(dim=1)
        return (probs / _race_noise(tuple(probs.shape), gens, probs.device)).argmax(dim=1)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The per-request generator for ``seed`` (``None``: the request uses the global RNG)."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)
