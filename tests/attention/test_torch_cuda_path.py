"""The PyTorch backend's CUDA path (4-D SDPA with enable_gqa, gathers into reused buffers), run on a CPU
against the CPU path, which is itself checked against transformers in tests/engine."""

from __future__ import annotations

import pytest
import torch
from paged_cases import CPU, PagedCase

from agentserve.executor.attention.torch_backend import TorchAttention


def cuda_style(case: PagedCase) -> TorchAttention:
    return TorchAttention(case.heads, case.kv_heads, case.head_dim, case.block_size, CPU, sdpa_prefill=True,
                          reuse_gathers=True, cascade_decode=False)


def test_cpu_defaults_keep_the_cpu_path():
    b = TorchAttention(4, 2, 16, 4, CPU)
    assert not b.sdpa_prefill and not b.reuse_gathers and b.cascade_decode


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("starts,lens", [([0, 0], [7, 12]), ([13, 5, 40], [9, 1, 3]), ([30, 2], [1, 1])])
def test_cuda_path_equals_reference(group, starts, lens):
    case = PagedCase(2 * group, 2, 16, 4, starts, lens, seed=group)
    got, kc, vc = case.run(cuda_style(case))
    want, want_kc, want_vc = case.reference()
    assert torch.allclose(got, want, atol=2e-6, rtol=1e-5)
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)


def test_gathers_reuse_one_buffer_across_layers():
    """Every layer of a forward pass gathers into the buffers the first layer made: no per-layer copy."""
    case = PagedCase(4, 2, 16, 4, starts=[20, 9], query_lens=[1, 1])
    backend = cuda_style(case)
    plan = backend.plan(case.batch())
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    first = backend.forward(case.q, case.k, case.v, kc, vc, plan)
    ptrs = {key: t.data_ptr() for key, t in plan.buffers._bufs.items()}
    assert set(ptrs) == {"k", "v"}
    second = backend.forward(case.q, case.k, case.v, kc, vc, plan)  # the next layer
    assert {key: t.data_ptr() for key, t in plan.buffers._bufs.items()} == ptrs
    assert torch.equal(first, second)
