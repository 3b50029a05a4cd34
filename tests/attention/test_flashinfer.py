"""FlashInfer: metadata built from block tables against a position-by-position reference (CPU, no FlashInfer
needed), clean refusal where it cannot run, and its kernels against the Triton backend (``gpu``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from paged_cases import CPU, PagedCase

from agentserve.executor import attention
from agentserve.executor.attention import cascade, flashinfer_meta
from agentserve.executor.errors import EngineError


def pages_of(table: list[int], n: int, bs: int) -> list[tuple[int, int]]:
    """Reference: the (block, row) of each position 0 .. n - 1."""
    return [(table[p // bs], p % bs) for p in range(n)]


def expand(kv: flashinfer_meta.PagedKV, i: int, bs: int) -> list[tuple[int, int]]:
    """FlashInfer's reading of sequence ``i``: every row of its full pages, then last_page_len rows."""
    pages = kv.indices[kv.indptr[i] : kv.indptr[i + 1]]
    assert 1 <= kv.last_page_len[i] <= bs
    return [(pg, r) for pg in pages[:-1] for r in range(bs)] + [(pages[-1], r) for r in range(kv.last_page_len[i])]


tables_st = st.integers(1, 6).flatmap(lambda b: st.tuples(
    st.lists(st.integers(1, 90), min_size=b, max_size=b), st.integers(1, 16), st.integers(0, 2**16)))


def scattered(lens: list[int], bs: int, seed: int, shared: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in lens]
    order = torch.randperm(shared + sum(need), generator=g).tolist()
    prefix, used, out = order[:shared], shared, []
    for n in need:
        out.append(prefix + order[used : used + n])
        used += n
    return [t + [999] for t in out]  # a stale block past the end must never be read


@settings(max_examples=60, deadline=None)
@given(tables_st)
def test_paged_kv_reads_exactly_each_sequences_positions(args):
    lens, bs, seed = args
    tables = scattered(lens, bs, seed)
    kv = flashinfer_meta.paged_kv(tables, lens, bs)
    assert len(kv.indptr) == len(lens) + 1 and kv.indptr[-1] == len(kv.indices)
    for i, (t, n) in enumerate(zip(tables, lens, strict=True)):
        assert expand(kv, i, bs) == pages_of(t, n, bs)


def test_qo_indptr():
    assert flashinfer_meta.qo_indptr([3, 1, 5]) == [0, 3, 4, 9]


@settings(max_examples=60, deadline=None)
@given(shared=st.integers(0, 6), own=st.lists(st.integers(1, 40), min_size=1, max_size=5), bs=st.integers(1, 8),
       seed=st.integers(0, 2**16))
def test_cascade_levels_cover_each_sequence_once(shared, own, bs, seed):
    """Level 0 (shared, read by every query) followed by level 1 (own) is exactly each sequence's positions."""
    lens = [shared * bs + n for n in own]
    tables = scattered(own, bs, seed, shared=shared)
    levels = flashinfer_meta.cascade_levels(tables, lens, bs, min_shared_tokens=1)
    if levels is None:
        assert len(own) == 1 or shared == 0 or cascade.shared_blocks(tables, lens, bs) == 0
        return
    (top_q, own_q), (top, mine) = levels.qo_indptr, levels.kv
    assert top_q == [0, len(own)] and own_q == list(range(len(own) + 1))
    assert top.indptr == [0, len(top.indices)] and top.last_page_len == [bs]
    for i, (t, n) in enumerate(zip(tables, lens, strict=True)):
        assert expand(top, 0, bs) + expand(mine, i, bs) == pages_of(t, n, bs)


def test_cascade_needs_enough_shared_tokens():
    tables = [[0, 1, 2, 3], [0, 1, 2, 4]]
    assert flashinfer_meta.cascade_levels(tables, [50, 50], 16, min_shared_tokens=64) is None
    assert flashinfer_meta.cascade_levels(tables, [50, 50], 16, min_shared_tokens=48) is not None


def test_paged_kv_refuses_an_empty_sequence():
    with pytest.raises(ValueError):
        flashinfer_meta.paged_kv([[0]], [0], 16)


def test_flashinfer_refused_on_cpu():
    with pytest.raises(EngineError, match="flashinfer"):
        attention.create_backend("flashinfer", 4, 2, 16, 4, CPU, torch.float32)


def test_auto_on_cuda_prefers_flashinfer_then_triton_then_torch(monkeypatch):
    present: set[str] = set()
    monkeypatch.setattr(attention, "installed", lambda name: name in present)
    assert attention.cuda_default() == "torch"
    present.add("triton")
    assert attention.cuda_default() == "triton"
    present.add("flashinfer")
    assert attention.cuda_default() == "flashinfer"


def test_missing_flashinfer_says_how_to_install(monkeypatch):
    import builtins

    from agentserve.executor.attention import flashinfer_backend

    real = builtins.__import__

    def no_flashinfer(name, *args, **kwargs):
        if name == "flashinfer":
            raise ImportError("No module named 'flashinfer'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_flashinfer)
    with pytest.raises(EngineError, match=r"agentserve\[cuda\]"):
        flashinfer_backend.import_flashinfer()


needs_flashinfer = pytest.mark.skipif(
    not torch.cuda.is_available() or not attention.installed("flashinfer"), reason="needs CUDA and FlashInfer")


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("starts,lens", [([40, 300, 7], [1, 1, 1]), ([0, 33, 5], [17, 40, 1])])
@pytest.mark.parametrize("group", [1, 4])
def test_flashinfer_matches_triton_on_gpu(starts, lens, group):
    from agentserve.executor.attention.flashinfer_backend import FlashInferAttention
    from agentserve.executor.attention.triton_backend import TritonAttention

    dev = torch.device("cuda")
    case = PagedCase(2 * group, 2, 128, 16, starts, lens, seed=group, dtype=torch.bfloat16)
    for name in ("k_cache", "v_cache", "q", "k", "v"):
        setattr(case, name, getattr(case, name).to(dev))
    shape = (case.heads, case.kv_heads, case.head_dim, case.block_size, dev)
    fi, _, _ = case.run(FlashInferAttention(*shape, dtype=torch.bfloat16))
    tr, _, _ = case.run(TritonAttention(*shape))
    assert (fi.float() - tr.float()).abs().max().item() < 2e-2


@pytest.mark.gpu
@needs_flashinfer
def test_flashinfer_cascade_matches_plain_decode_on_gpu(monkeypatch):
    from agentserve.executor.attention.flashinfer_backend import FlashInferAttention

    dev = torch.device("cuda")
    case = PagedCase(8, 2, 128, 16, [64, 64, 64], [1, 1, 1], seed=1, dtype=torch.bfloat16)
    case.tables = [[0, 1, 2, 3, 4 + i] for i in range(3)]  # 4 shared blocks, then one each
    for name in ("k_cache", "v_cache", "q", "k", "v"):
        setattr(case, name, getattr(case, name).to(dev))
    shape = (case.heads, case.kv_heads, case.head_dim, case.block_size, dev)
    monkeypatch.setattr(cascade, "MIN_SHARED_TOKENS", 16)
    casc, _, _ = case.run(FlashInferAttention(*shape, dtype=torch.bfloat16))
    plain, _, _ = case.run(FlashInferAttention(*shape, dtype=torch.bfloat16, cascade_decode=False))
    assert (casc.float() - plain.float()).abs().max().item() < 2e-2
