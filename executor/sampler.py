"""Token sampling for a batch of logits rows, each with its own :class:`SamplingParams`.

Greedy rows take the argmax.  Sampled rows are scaled by temperature, filtered by top-k, top-p and
min-p (in that order), then drawn with the exponential-race trick: ``argmax(p / q)`` with
``q ~ Exp(1)`` is a draw from ``p``.  A seeded request draws its ``q`` from its own generator, one
full-vocabulary row per step, so its tokens depend only on its seed and its own logits — never on
which other requests share the batch.  The logprob is the log-softmax of the unmodified logits at
the chosen token; :meth:`Sampler.top_logprobs` reads the most likely tokens from the same logits.
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
        logits = logits.float()
        tokens = logits.argmax(dim=1)
        rows = [i for i, p in enumerate(params) if p.temperature > 0.0 and p.top_k != 1]
        if rows:
            tokens[rows] = self._draw(logits[rows], [params[i] for i in rows], [generators[i] for i in rows])
        logprobs = logits.log_softmax(dim=1).gather(1, tokens.unsqueeze(1)).squeeze(1)
        # one device-to-host copy for both (fp64 holds every token id and fp32 logprob exactly)
        host = torch.stack((tokens.to(torch.float64), logprobs.to(torch.float64))).tolist()
        return [int(t) for t in host[0]], host[1]

    def top_logprobs(self, logits: torch.Tensor, counts: list[int]) -> list[tuple[list[int], list[float]]]:
        """Row ``i``'s ``counts[i]`` most likely tokens and their logprobs, most likely first.

        Only rows asking for some are computed; one device-to-host copy for all of them."""
        out: list[tuple[list[int], list[float]]] = [([], []) for _ in counts]
        rows = [i for i, k in enumerate(counts) if k > 0]
        if not rows:
            return out
        k = min(max(counts[i] for i in rows), logits.shape[1])
        values, ids = logits[rows].float().log_softmax(dim=1).topk(k, dim=1, sorted=True)
        host = torch.stack((ids.to(torch.float64), values.to(torch.float64))).tolist()
        for j, i in enumerate(rows):
            n = counts[i]
            out[i] = ([int(t) for t in host[0][j][:n]], host[1][j][:n])
        return out

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
