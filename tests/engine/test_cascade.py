"""Shared-prefix (cascade) decode: the split-and-merge attention equals plain paged decode, and the runner's
logits on a batch sharing a cached prefix still match transformers."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import REL_TOL, hf_logits, random_prompts, rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

from agentserve.executor.attention import cascade
from agentserve.executor.attention.base import AttentionBatch
from agentserve.executor.attention.torch_backend import TorchAttention
from agentserve.executor.runner import DecodeItem, ModelRunner, PrefillChunk


def test_shared_blocks_stops_at_first_difference_and_before_each_last_block():
    assert cascade.shared_blocks([[1, 2, 3, 4]], [64], 16) == 0  # one row: nothing to share
    assert cascade.shared_blocks([[1, 2, 3, 9], [1, 2, 5, 9]], [64, 64], 16) == 2
    # identical tables up to the end: the block each sequence writes into is never shared
    assert cascade.shared_blocks([[1, 2, 3], [1, 2, 3, 4]], [33, 64], 16) == 2
    assert cascade.shared_blocks([[1, 2], [1, 2]], [17, 32], 16) == 1
    assert cascade.shared_blocks([[7], [7]], [3, 9], 16) == 0


def test_merge_equals_attention_over_the_union():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 8), torch.randn(40, 8), torch.randn(40, 8)
    def part(ks, vs):
        s = q @ ks.T
        return torch.softmax(s, -1) @ vs, torch.logsumexp(s, -1)
    whole = torch.softmax(q @ k.T, -1) @ v
    merged = cascade.merge(*part(k[:25], v[:25]), *part(k[25:], v[25:]))
    assert torch.allclose(merged, whole, atol=1e-6)


def _decode_batch(prefix_blocks: int, own: list[int], block_size: int, scatter: bool = False) -> AttentionBatch:
    """Rows share ``prefix_blocks`` blocks (consecutive, or reversed with ``scatter``), then row ``i`` has
    ``own[i]`` more tokens in blocks of its own."""
    tables, lens, nxt = [], [], prefix_blocks
    prefix = list(range(prefix_blocks))[:: -1 if scatter else 1]
    for n in own:
        mine = -(-n // block_size)
        tables.append(prefix + list(range(nxt, nxt + mine)))
        lens.append(prefix_blocks * block_size + n)
        nxt += mine
    slots = torch.tensor([t[(n - 1) // block_size] * block_size + (n - 1) % block_size
                          for t, n in zip(tables, lens, strict=True)])
    return AttentionBatch(True, [1] * len(own), [n - 1 for n in lens], tables, slots)


@settings(max_examples=40, deadline=None)
@given(prefix_blocks=st.integers(0, 6), own=st.lists(st.integers(1, 40), min_size=1, max_size=5),
       group=st.sampled_from([1, 2, 4]), scatter=st.booleans(), seed=st.integers(0, 2**16))
def test_cascade_decode_equals_plain_decode(prefix_blocks, own, group, scatter, seed):
    """Gathered or (consecutive blocks) read in place, the shared prefix gives plain decode's result."""
    bs, kvh, d = 4, 2, 8
    plain = TorchAttention(kvh * group, kvh, d, bs, torch.device("cpu"), cascade_decode=False)
    casc = TorchAttention(kvh * group, kvh, d, bs, torch.device("cpu"), cascade_decode=True)
    batch = _decode_batch(prefix_blocks, own, bs, scatter)
    g = torch.Generator().manual_seed(seed)
    num_blocks = prefix_blocks + sum(-(-n // bs) for n in own)
    k_cache, v_cache = (torch.randn(num_blocks, bs, kvh, d, generator=g) for _ in range(2))
    q = torch.randn(len(own), kvh * group, d, generator=g)
    k, v = (torch.randn(len(own), kvh, d, generator=g) for _ in range(2))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cascade, "MIN_SHARED_TOKENS", 1)
        plan = casc.plan(batch)
    assert (plan.shared is not None) == (len(own) > 1 and prefix_blocks > 0)
    assert (plan.shared_run is not None) == (plan.shared is not None and not (scatter and prefix_blocks > 1))
    want = plain.forward(q, k, v, k_cache.clone(), v_cache.clone(), plain.plan(batch))
    got = casc.forward(q, k, v, k_cache.clone(), v_cache.clone(), plan)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def test_runner_cascade_decode_matches_transformers(case, monkeypatch):
    """Three sequences share a 48-token cached prefix (6 blocks) and go on differently; their batched
    decode takes the cascade path and each row's logits equal transformers on that row's whole text."""
    monkeypatch.setattr(cascade, "MIN_SHARED_TOKENS", 16)
    runner = ModelRunner(case.path, dtype="float32", device="cpu", num_blocks=64, block_size=8,
                         attention_backend="torch")  # the compiled kernel has no Python cascade split
    prefix = random_prompts([48], seed=5)[0]
    tails = random_prompts([3, 17, 30], seed=6)
    runner.prefill([PrefillChunk(prefix, 0, list(range(6)))])
    tables = [list(range(6)) + list(range(6 + 8 * i, 14 + 8 * i)) for i in range(3)]
    runner.prefill([PrefillChunk(t, 48, tb) for t, tb in zip(tails, tables, strict=True)])
    nxt = [5, 9, 13]
    items = [DecodeItem(x, 48 + len(t), tb) for x, t, tb in zip(nxt, tails, tables, strict=True)]
    seen = []
    plan = runner.attention.plan
    monkeypatch.setattr(runner.attention, "plan", lambda b: seen.append(plan(b)) or seen[-1])
    got = runner.decode(items)
    assert seen[0].shared is not None and seen[0].shared.tolist() == list(range(6))
    assert seen[0].shared_run == 0  # blocks 0-5: read in place
    for row, t, x in zip(got, tails, nxt, strict=True):
        ref = hf_logits(case.hf, prefix + t + [x])[-1]
        assert rel_err(row, ref) < REL_TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_cascade_keeps_low_precision_dtype(dtype, monkeypatch):
    monkeypatch.setattr(cascade, "MIN_SHARED_TOKENS", 1)
    attn = TorchAttention(4, 2, 8, 4, torch.device("cpu"), cascade_decode=True)
    batch = _decode_batch(2, [3, 5], 4)
    k_cache, v_cache = (torch.randn(6, 4, 2, 8, dtype=dtype) for _ in range(2))
    q, k, v = torch.randn(2, 4, 8, dtype=dtype), torch.randn(2, 2, 8, dtype=dtype), torch.randn(2, 2, 8, dtype=dtype)
    out = attn.forward(q, k, v, k_cache, v_cache, attn.plan(batch))
    assert out.dtype == dtype and out.shape == (2, 32) and torch.isfinite(out).all()
