"""Sampler properties: greedy is argmax, filters never let excluded tokens through, seeds reproduce
independently of the batch, the empirical distribution matches softmax, logprobs are exact."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentserve.executor.sampler import Sampler, make_generator
from agentserve.protocol.sampling import Finish, SamplingParams
from agentserve.protocol.stopping import finish_reason

SAMPLER = Sampler()


def distinct_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Rows of logits with no ties (a random permutation of spaced values plus noise)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.arange(vocab, dtype=torch.float32) * 0.37
    return torch.stack([base[torch.randperm(vocab, generator=g)] for _ in range(rows)]) - 3.0


def sample_many(logits_row: torch.Tensor, p: SamplingParams, n: int, seed: int) -> list[int]:
    """``n`` independent draws: ``n`` copies of the row, each with its own seeded generator."""
    gens = [make_generator(seed * 1000 + i) for i in range(n)]
    tokens, _ = SAMPLER.sample(logits_row.expand(n, -1).clone(), [p] * n, gens)
    return tokens


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 6), vocab=st.integers(2, 50), seed=st.integers(0, 1000))
def test_greedy_is_argmax_with_exact_logprob(rows, vocab, seed):
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 4
    tokens, logprobs = SAMPLER.sample(logits, [SamplingParams()] * rows, [None] * rows)
    assert tokens == logits.argmax(1).tolist()
    want = logits.log_softmax(1)[torch.arange(rows), logits.argmax(1)]
    assert logprobs == pytest.approx(want.tolist(), abs=1e-6)


@settings(max_examples=30, deadline=None)
@given(vocab=st.integers(3, 40), k=st.integers(1, 45), temp=st.floats(0.3, 3.0), seed=st.integers(0, 10**6))
def test_top_k_never_picks_outside_top_k(vocab, k, temp, seed):
    logits = distinct_logits(1, vocab, seed)[0]
    allowed = set(logits.topk(min(k, vocab)).indices.tolist())
    tokens = sample_many(logits, SamplingParams(temperature=temp, top_k=k), 64, seed)
    assert set(tokens) <= allowed


def nucleus(logits: torch.Tensor, temp: float, top_p: float) -> set[int]:
    """Reference: the smallest set of best tokens whose probability mass reaches ``top_p``."""
    probs = (logits / temp).softmax(0)
    order = probs.argsort(descending=True).tolist()
    kept, mass = set(), 0.0
    for t in order:
        kept.add(t)
        mass += probs[t].item()
        if mass >= top_p:
            break
    return kept


@settings(max_examples=30, deadline=None)
@given(vocab=st.integers(3, 40), top_p=st.floats(0.05, 0.95), temp=st.floats(0.3, 3.0), seed=st.integers(0, 10**6))
def test_top_p_never_picks_outside_nucleus(vocab, top_p, temp, seed):
    logits = distinct_logits(1, vocab, seed)[0]
    allowed = nucleus(logits, temp, top_p)
    tokens = sample_many(logits, SamplingParams(temperature=temp, top_p=top_p), 64, seed)
    assert set(tokens) <= allowed


@settings(max_examples=30, deadline=None)
@given(vocab=st.integers(3, 40), min_p=st.floats(0.01, 1.0), temp=st.floats(0.3, 3.0), seed=st.integers(0, 10**6))
def test_min_p_never_picks_unlikely_tokens(vocab, min_p, temp, seed):
    logits = distinct_logits(1, vocab, seed)[0]
    probs = (logits / temp).softmax(0)
    allowed = set(torch.nonzero(probs >= min_p * probs.max()).flatten().tolist())
    tokens = sample_many(logits, SamplingParams(temperature=temp, min_p=min_p), 64, seed)
    assert set(tokens) <= allowed


def test_mixed_batch_applies_each_rows_own_filters():
    logits = distinct_logits(4, 30, 7)
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=2),
              SamplingParams(temperature=1.0, top_p=0.3), SamplingParams(temperature=2.0)]
    for step in range(50):
        tokens, _ = SAMPLER.sample(logits, params, [make_generator(step * 4 + i) for i in range(4)])
        assert tokens[0] == logits[0].argmax().item()
        assert tokens[1] in logits[1].topk(2).indices.tolist()
        assert tokens[2] in nucleus(logits[2], 1.0, 0.3)


def test_seed_reproducible_and_batch_independent():
    logits = distinct_logits(5, 64, 3)
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=42)

    def run(row: int, batch_rows: list[int], others_seeded: bool) -> list[int]:
        gen = make_generator(42)
        out = []
        for _ in range(20):
            params = [p if r == row else SamplingParams(temperature=0.7) for r in batch_rows]
            gens = [gen if r == row else (make_generator(r) if others_seeded else None) for r in batch_rows]
            tokens, _ = SAMPLER.sample(logits[batch_rows], params, gens)
            out.append(tokens[batch_rows.index(row)])
        return out

    alone = run(2, [2], False)
    assert run(2, [2], False) == alone
    assert run(2, [0, 1, 2, 3, 4], False) == alone
    assert run(2, [4, 2, 0], True) == alone
    assert len(set(alone)) > 1  # it really samples
    other = SAMPLER.sample(logits[[2]].expand(20, -1), [p] * 20, [make_generator(43) for _ in range(20)])[0]
    assert other != alone  # a different seed gives a different stream


def test_empirical_distribution_matches_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    n = 20000
    tokens = sample_many(logits[0], SamplingParams(temperature=1.0), n, seed=5)
    freq = torch.bincount(torch.tensor(tokens), minlength=5).float() / n
    assert torch.allclose(freq, logits[0].softmax(0), atol=0.015)


def test_temperature_sharpens_and_logprob_uses_unmodified_logits():
    logits = torch.tensor([[1.0, 0.8, 0.0]])
    cold = sample_many(logits[0], SamplingParams(temperature=0.05), 400, seed=1)
    hot = sample_many(logits[0], SamplingParams(temperature=5.0), 400, seed=1)
    assert cold.count(0) > 390 and hot.count(2) > 60
    tokens, logprobs = SAMPLER.sample(logits.expand(3, -1).clone(), [SamplingParams(temperature=5.0, seed=1)] * 3,
                                      [make_generator(i) for i in range(3)])
    ref = logits[0].log_softmax(0)
    assert logprobs == pytest.approx([ref[t].item() for t in tokens], abs=1e-6)


def test_finish_reason():
    p = SamplingParams(max_tokens=3, stop_token_ids=[7])
    eos = [2]
    assert finish_reason(5, 1, p, eos) == Finish.NONE
    assert finish_reason(7, 1, p, eos) == Finish.STOP
    assert finish_reason(2, 1, p, eos) == Finish.STOP
    assert finish_reason(5, 3, p, eos) == Finish.LENGTH
    assert finish_reason(2, 1, SamplingParams(ignore_eos=True), eos) == Finish.NONE
    assert finish_reason(7, 1, SamplingParams(ignore_eos=True, stop_token_ids=[7]), eos) == Finish.STOP
    assert finish_reason(5, 1, p, eos, seq_len=100, max_model_len=100) == Finish.LENGTH


def tops_of(logits: torch.Tensor, counts: list[int]) -> list[tuple[list[int], list[float]]]:
    """Greedy rows asking for ``counts[i]`` top logprobs each: what the sampler returns beside the tokens."""
    params = [SamplingParams(top_logprobs=k) for k in counts]
    return SAMPLER.sample_with_top(logits, params, [None] * len(counts))[2]


@settings(max_examples=40, deadline=None)
@given(counts=st.lists(st.integers(0, 20), min_size=1, max_size=6), vocab=st.integers(20, 60),
       seed=st.integers(0, 1000))
def test_top_logprobs_are_the_most_likely_tokens_whatever_the_batch(counts, vocab, seed):
    logits = distinct_logits(len(counts), vocab, seed) * 0.5
    tops = tops_of(logits, counts)
    ref = logits.log_softmax(1)
    for i, (k, (ids, lps)) in enumerate(zip(counts, tops, strict=True)):
        want = ref[i].argsort(descending=True)[:k].tolist()
        assert ids == want
        assert lps == pytest.approx(ref[i, want].tolist(), abs=1e-6)
        alone = tops_of(logits[i:i + 1].clone(), [k])[0]  # the same alone as in the batch
        assert alone[0] == ids and alone[1] == pytest.approx(lps, abs=1e-6)


def test_greedy_token_heads_its_top_logprobs():
    logits = distinct_logits(3, 40, 7)
    tokens, logprobs = SAMPLER.sample(logits, [SamplingParams()] * 3, [None] * 3)
    tops = tops_of(logits, [5, 1, 0])
    assert [t[0][:1] for t in tops[:2]] == [[tokens[0]], [tokens[1]]]
    assert tops[0][1][0] == pytest.approx(logprobs[0], abs=1e-6)
    assert tops[2] == ([], [])
