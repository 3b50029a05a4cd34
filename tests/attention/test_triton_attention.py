"""The Triton paged-attention kernels, run in Triton's CPU interpreter, against the PyTorch paged reference.

Interpreter runs are slow (every program is run in numpy), so shapes stay small; long contexts hit split-K
through a low ``min_split_tokens``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from paged_cases import CPU, PagedCase

pytest.importorskip("triton")

from agentserve.executor.attention import create_backend, triton_kernels  # noqa: E402
from agentserve.executor.attention.triton_backend import (  # noqa: E402
    TritonAttention,
    TritonDecodePlan,
    choose_num_splits,
    padded_tables,
)

TOL = 2e-6


def triton_backend(case: PagedCase, **kwargs) -> TritonAttention:
    return TritonAttention(case.heads, case.kv_heads, case.head_dim, case.block_size, CPU, **kwargs)


def check(case: PagedCase, tol: float = TOL, **kwargs) -> TritonAttention:
    """Output and written caches equal the reference's; returns the backend used."""
    backend = triton_backend(case, **kwargs)
    got, kc, vc = case.run(backend)
    want, want_kc, want_vc = case.reference()
    assert got.shape == want.shape
    assert (got.float() - want).abs().max().item() <= tol
    assert torch.equal(kc.float(), want_kc) and torch.equal(vc.float(), want_vc)
    return backend


def test_kernels_run_in_the_interpreter():
    assert triton_kernels.INTERPRETED


# -- decode ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_decode_gqa_groups(group):
    check(PagedCase(2 * group, 2, 16, 4, starts=[5, 17, 30], query_lens=[1, 1, 1], seed=group))


@pytest.mark.parametrize("head_dim", [8, 12, 24, 80])
def test_decode_odd_head_sizes(head_dim):
    """Head sizes that are not powers of two run padded with masked loads."""
    check(PagedCase(4, 2, head_dim, 8, starts=[9, 21], query_lens=[1, 1], seed=head_dim))


@pytest.mark.parametrize("block_size", [1, 3, 16, 64])
def test_decode_block_sizes_and_partial_last_blocks(block_size):
    check(PagedCase(4, 1, 16, block_size, starts=[2, 40, 70], query_lens=[1, 1, 1], seed=block_size))


@pytest.mark.parametrize("splits", [2, 4, 8])
def test_decode_long_context_splits(splits):
    """Split-K: each sequence's keys in ``splits`` parts, merged by log-sum-exp; lengths not divisible."""
    case = PagedCase(8, 2, 16, 16, starts=[300, 45, 511], query_lens=[1, 1, 1], seed=splits)
    backend = check(case, min_split_tokens=64, max_splits=splits, sm_count=1000)
    assert backend.plan(case.batch()).num_splits == splits


def test_decode_of_an_empty_row_is_zero_not_nan():
    """A CUDA-graph batch pads with rows of length 0 and slot -1: they read and write nothing."""
    case = PagedCase(4, 2, 16, 4, starts=[10], query_lens=[1])
    tables = torch.tensor([case.tables[0] + [0], [0] * 4], dtype=torch.int32)
    q = torch.randn(2, 4, 16)
    out = triton_kernels.paged_decode(q, case.k_cache, case.v_cache, tables,
                                      torch.tensor([11, 0], dtype=torch.int32), 0.25, 4)
    assert torch.equal(out[1], torch.zeros(64)) and not out.isnan().any()


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_decode_half_precision_caches(dtype, tol):
    check(PagedCase(8, 2, 24, 4, starts=[33, 7], query_lens=[1, 1], seed=3, dtype=dtype), tol=tol,
          min_split_tokens=16, sm_count=1000)


# -- prefill ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_prefill_with_cached_prefix(group):
    """Fresh chunks, chunks after a cached prefix, causal within each chunk."""
    check(PagedCase(2 * group, 2, 16, 4, starts=[0, 13, 6], query_lens=[9, 20, 3], seed=group))


@pytest.mark.parametrize("head_dim,block_size", [(12, 1), (24, 3), (80, 16), (8, 64)])
def test_prefill_odd_head_sizes_and_blocks(head_dim, block_size):
    check(PagedCase(4, 2, head_dim, block_size, starts=[5, 0], query_lens=[19, 11], seed=head_dim))


def test_prefill_mixed_with_decode_rows():
    """A mixed step: one-token continuations ride in the same ragged batch as prefill chunks."""
    check(PagedCase(8, 2, 16, 4, starts=[40, 0, 17, 3], query_lens=[1, 25, 1, 6], seed=7))


def test_prefill_tiles_cover_long_chunks():
    """A chunk longer than one program's query tile, after a prefix spanning many blocks."""
    check(PagedCase(4, 4, 16, 8, starts=[70], query_lens=[45], seed=11))


def test_prefill_half_precision():
    check(PagedCase(8, 2, 24, 4, starts=[10, 0], query_lens=[7, 12], seed=5, dtype=torch.bfloat16), tol=2e-2)


# -- KV writes, planning ---------------------------------------------------------------------------


def test_store_kv_writes_slots_and_skips_negative_ones():
    k_cache, v_cache = torch.zeros(6, 4, 2, 8), torch.zeros(6, 4, 2, 8)
    k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    v_strided = torch.cat([v, torch.randn(4, 2, 8)], dim=2)[:, :, :8]  # as the model's split qkv view
    slots = torch.tensor([3, -1, 23, 0])
    triton_kernels.store_kv(k, v_strided, k_cache, v_cache, slots)
    want_k, want_v = torch.zeros(24, 2, 8), torch.zeros(24, 2, 8)
    want_k[[3, 23, 0]], want_v[[3, 23, 0]] = k[[0, 2, 3]], v[[0, 2, 3]]
    assert torch.equal(k_cache.view(24, 2, 8), want_k) and torch.equal(v_cache.view(24, 2, 8), want_v)


def test_choose_num_splits():
    assert choose_num_splits(64, 8, 8192, 132) == 1  # 512 programs already fill 132 SMs
    assert choose_num_splits(1, 8, 8192, 132) == 16  # 33 wanted, capped at 16
    assert choose_num_splits(1, 8, 300, 132) == 2  # never a split under 256 keys: ceil(300/256) = 2
    assert choose_num_splits(4, 8, 2048, 132) == 8  # 9 wanted, rounded down to a power of two
    assert choose_num_splits(1, 1, 10, 132) == 1


def test_padded_tables_cut_to_used_blocks():
    assert padded_tables([[5, 6, 7, 8], [1]], [9, 3], 4) == [[5, 6, 7], [1, 0, 0]]


def test_plan_is_small_int32_tensors():
    case = PagedCase(4, 2, 16, 4, starts=[5, 17], query_lens=[1, 1])
    plan = triton_backend(case).plan(case.batch())
    assert isinstance(plan, TritonDecodePlan)
    assert plan.block_tables.dtype == plan.seq_lens.dtype == torch.int32
    assert plan.seq_lens.tolist() == [6, 18] and plan.block_tables.shape == (2, 5)


def test_create_backend_selects_triton_here():
    backend = create_backend("triton", 4, 2, 16, 4, CPU, torch.float32)
    assert isinstance(backend, TritonAttention)


@settings(max_examples=12, deadline=None)
@given(group=st.sampled_from([1, 2, 4, 8]), kv_heads=st.integers(1, 2), head_dim=st.sampled_from([8, 12, 16, 20]),
       block_size=st.integers(1, 64), starts=st.lists(st.integers(0, 90), min_size=1, max_size=3),
       chunk=st.integers(1, 12), decode=st.booleans(), seed=st.integers(0, 2**16))
def test_generated_shapes(group, kv_heads, head_dim, block_size, starts, chunk, decode, seed):
    if decode:
        starts = [s + 1 for s in starts]
    lens = [1 if decode else chunk] * len(starts)
    check(PagedCase(group * kv_heads, kv_heads, head_dim, block_size, starts, lens, seed),
          min_split_tokens=32, sm_count=1000)


@pytest.mark.parametrize("block_size,num_blocks", [(1, 300), (16, 20), (64, 3)])
def test_warmup_runs_every_kind_of_step(block_size, num_blocks):
    """Start-up warm-up (kernel compilation on a GPU) runs each batch kind and every split count."""
    backend = TritonAttention(4, 2, 16, block_size, CPU, max_splits=4)
    kinds = backend.warmup_batches(num_blocks)
    assert [b.is_decode for b in kinds] == ([True, False, True] if num_blocks * block_size >= 272 else [True, False])
    k_cache, v_cache = torch.randn(num_blocks, block_size, 2, 16), torch.randn(num_blocks, block_size, 2, 16)
    backend.warmup(k_cache, v_cache)
    assert not k_cache.isnan().any()
