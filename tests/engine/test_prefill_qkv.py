"""The compiled prefill q/k/v step (``fused/prefill_qkv.c``): a qkv product's rows (bf16 or fp32) to rotated queries
(bf16 or fp32) and fp16 keys and values in one pass, bitwise what PyTorch's passes give (widen, bias, the model's
rotary, casts) for random rows of any head layout, with and without a bias, on any thread count, and at the delicate
values (bf16 ties, fp32 subnormals, values past fp16's range, NaN, exact cancellations); also in the AVX2 build; bad
arguments refused; and a runner's logits bitwise the same with it as without it, whole, resumed and batched, for
every architecture case (Qwen3's q/k norms before it in PyTorch), with hybrid and packed fp16 matrices, under
PyTorch's bf16 attention and the compiled prefill kernels."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from engine_helpers import cpu_has, random_prompts
from hypothesis import given, settings
from hypothesis import strategies as st

from agentserve.executor.fused import prefill_qkv
from agentserve.executor.kernels import build
from agentserve.executor.layers import Rotary
from agentserve.executor.linear import fp16_packing_available
from agentserve.executor.runner import ModelRunner, PrefillChunk

KERNEL = prefill_qkv.load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C compiler with F16C builds the CPU library here")
CPU = torch.device("cpu")


def pytorch_passes(y: torch.Tensor, bias: torch.Tensor | None, rotary: Rotary, positions: torch.Tensor, heads: int,
                   kv_heads: int, queries: torch.dtype = torch.bfloat16,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the model and the attention backend do without the kernel."""
    t, dim = y.shape[0], rotary.cos.shape[-1]
    x = y.float() if bias is None else y.float() + bias  # never in place: for fp32 rows y.float() is y
    q, k, v = x.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    cos, sin = rotary.tables(positions)
    q = rotary.apply(q.view(t, heads, dim), cos, sin)
    k = rotary.apply(k.reshape(t, kv_heads, dim), cos, sin)
    return q.to(queries), k.to(torch.float16), v.reshape(t, kv_heads, dim).to(torch.float16)


def through_kernel(y, bias, rotary, positions, heads, kv_heads, threads=1, queries=torch.bfloat16):
    cos, sin = rotary.tables(positions)
    return KERNEL(y, bias, cos.squeeze(1), sin.squeeze(1), heads, kv_heads, threads, queries)


def assert_same_bits(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        nan = w.isnan()
        assert torch.equal(g.isnan(), nan)
        bits = torch.int32 if w.dtype == torch.float32 else torch.int16
        assert torch.equal(g.view(bits)[~nan], w.view(bits)[~nan])


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), kv_heads=st.integers(1, 3), group=st.integers(1, 4),
       dim=st.sampled_from([2, 6, 16, 64, 80, 128]), with_bias=st.booleans(), threads=st.integers(1, 3),
       start=st.integers(0, 3000), scale=st.sampled_from([1e-3, 1.0, 300.0]),
       queries=st.sampled_from([torch.bfloat16, torch.float32]),
       product=st.sampled_from([torch.bfloat16, torch.float32]), seed=st.integers(0, 2**16))
def test_random_rows_come_out_bitwise_as_pytorchs_passes(rows, kv_heads, group, dim, with_bias, threads, start, scale,
                                                        queries, product, seed):
    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    width = (heads + 2 * kv_heads) * dim
    y = (torch.randn(rows, width, generator=g) * scale).to(product)  # hybrid matrices' bf16, packed fp16's fp32
    bias = torch.randn(width, generator=g) * scale if with_bias else None
    rotary = Rotary(dim, 10000.0, None, start + rows, torch.float32, CPU)
    positions = torch.arange(start, start + rows)
    assert_same_bits(through_kernel(y, bias, rotary, positions, heads, kv_heads, threads, queries),
                     pytorch_passes(y, bias, rotary, positions, heads, kv_heads, queries))


def delicate_rows(dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of one head each for q, k and v, full of values whose rounding is delicate, a bias with a NaN whose payload
    is only in its low bits (bf16 rounding must not carry it into infinity), and a fifth row of zeros: the rotation's
    exact cancellations (x * cos - x2 * sin of equal products) must give PyTorch's +0, not -0."""
    values = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-126, -(2**-130), 3e-39, 65504.0, 65520.0,
                           7e4, -1e30, float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1 / 3, 2**-24, 2**-25])
    y = values.repeat(-(-3 * dim * 4 // len(values)))[: 3 * dim * 4].view(4, 3 * dim)
    y = torch.cat([y, torch.zeros(1, 3 * dim)]).bfloat16()
    low_nan = torch.tensor([0x7F800001], dtype=torch.int32).view(torch.float32)
    bias = torch.cat([low_nan, torch.tensor([2**-9, -(2**-9), 0.0, 1e-40] * (3 * dim // 4 + 1))])[: 3 * dim]
    return y, bias


@pytest.mark.parametrize("dim", [16, 20])  # 16-wide vectors only; and a tail on either class
@pytest.mark.parametrize("queries", [torch.bfloat16, torch.float32])
def test_ties_subnormals_overflow_and_nan_come_out_as_pytorchs(dim, queries):
    y, bias = delicate_rows(dim)
    rotary = Rotary(dim, 10000.0, None, 64, torch.float32, CPU)
    positions = torch.tensor([0, 1, 17, 63, 32])
    for b in (bias, None):
        assert_same_bits(through_kernel(y, b, rotary, positions, 1, 1, queries=queries),
                         pytorch_passes(y, b, rotary, positions, 1, 1, queries))


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 30), kv_heads=st.integers(1, 3), group=st.integers(1, 4), dim=st.sampled_from([6, 16, 64]),
       threads=st.integers(1, 3), queries=st.sampled_from([torch.bfloat16, torch.float32]), seed=st.integers(0, 2**16))
def test_q_and_k_given_apart_from_the_products_v_come_out_as_pytorchs_passes(rows, kv_heads, group, dim, threads,
                                                                           queries, seed):
    """Qwen3's layout: q and k through the q/k norms (their own tensors, fp32) beside the product's v column (a strided
    slice); each input read with its own row stride."""
    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    product = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g)
    q_in, k_in = torch.randn(rows, heads * dim, generator=g), torch.randn(rows, kv_heads * dim, generator=g) * 3
    v_in = product[:, (heads + kv_heads) * dim:]
    rotary = Rotary(dim, 10000.0, None, rows + 7, torch.float32, CPU)
    positions = torch.arange(7, 7 + rows)
    cos, sin = rotary.tables(positions)
    got = KERNEL.parts(q_in, k_in, v_in, None, cos.squeeze(1), sin.squeeze(1), threads, queries)
    want = pytorch_passes(torch.cat([q_in, k_in, v_in], dim=1), None, rotary, positions, heads, kv_heads, queries)
    assert_same_bits(got, want)


def test_bad_parts_are_refused():
    q, k, v, cos = torch.zeros(3, 32), torch.zeros(3, 8), torch.zeros(3, 8), torch.zeros(3, 8)
    assert [t.shape for t in KERNEL.parts(q, k, v, None, cos, cos)] == [(3, 4, 8), (3, 1, 8), (3, 1, 8)]
    for bad in ((q, k, v.bfloat16()), (q, k[:2], v), (q, k, torch.zeros(3, 16)), (q, k, torch.zeros(3, 16)[:, ::2]),
                (q, torch.zeros(3, 12), torch.zeros(3, 12))):
        with pytest.raises(ValueError, match="prefill qkv needs"):
            KERNEL.parts(*bad, None, cos, cos)
    with pytest.raises(ValueError, match="prefill qkv needs"):
        KERNEL.parts(q, k, v, torch.zeros(47), cos, cos)  # the bias spans all three widths: 48


def test_bad_arguments_are_refused():
    y, cos = torch.zeros(3, 6 * 8, dtype=torch.bfloat16), torch.zeros(3, 8)
    assert all(t.shape[0] == 3 for t in KERNEL(y, None, cos, cos, 4, 1))
    with pytest.raises(ValueError, match="bf16"):
        KERNEL(y.half(), None, cos, cos, 4, 1)
    with pytest.raises(ValueError, match="heads"):
        KERNEL(y, None, cos, cos, 2, 1)  # the width is not (heads + 2 * kv_heads) * D
    with pytest.raises(ValueError, match="bias"):
        KERNEL(y, torch.zeros(5), cos, cos, 4, 1)
    with pytest.raises(ValueError, match="cos"):
        KERNEL(y, None, cos[:2], cos[:2], 4, 1)
    with pytest.raises(ValueError, match="contiguous"):
        KERNEL(torch.zeros(3, 2 * 6 * 8, dtype=torch.bfloat16)[:, ::2], None, cos, cos, 4, 1)
    with pytest.raises(ValueError, match="queries"):
        KERNEL(y, None, cos, cos, 4, 1, query_dtype=torch.float16)
    with pytest.raises(ValueError, match="odd"):
        KERNEL(torch.zeros(3, 6 * 7, dtype=torch.bfloat16), None, torch.zeros(3, 7), torch.zeros(3, 7), 4, 1)


AVX2_CHECK = """
import torch
from agentserve.executor.fused import prefill_qkv
from agentserve.executor.layers import Rotary
from agentserve.executor.linear import fp16_packing_available
kernel = prefill_qkv.load()
g = torch.Generator().manual_seed(5)
heads, kv, dim, rows = 6, 2, 40, 300
y = torch.randn(rows, (heads + 2 * kv) * dim, generator=g).bfloat16()
bias = torch.randn((heads + 2 * kv) * dim, generator=g)
rotary = Rotary(dim, 10000.0, None, 400, torch.float32, torch.device("cpu"))
cos, sin = rotary.tables(torch.arange(50, 50 + rows))
x = y.float().add_(bias)
q, k, v = x.split([heads * dim, kv * dim, kv * dim], dim=-1)
want = (rotary.apply(q.view(rows, heads, dim), cos, sin).to(torch.bfloat16),
        rotary.apply(k.reshape(rows, kv, dim), cos, sin).to(torch.float16), v.reshape(rows, kv, dim).to(torch.float16))
got = kernel(y, bias, cos.squeeze(1), sin.squeeze(1), heads, kv, 2)
print(all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(got, want)))
"""


def test_the_avx2_build_comes_out_as_pytorchs_passes(tmp_path):
    """The AVX2-only class (8-wide bf16 rounding, no AVX-512), checked on either class: a build with ``-mno-avx512f``
    in a fresh cache and process."""
    env = {**os.environ, build.DIR_ENV: str(tmp_path), build.CFLAGS_ENV: "-mno-avx512f"}
    done = subprocess.run([sys.executable, "-c", AVX2_CHECK], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "True"


class Counted:
    """The kernel, counting the model's calls."""

    def __init__(self, kernel: prefill_qkv.PrefillQkv) -> None:
        self.kernel, self.calls = kernel, 0

    def parts(self, *args):
        self.calls += 1
        return self.kernel.parts(*args)


SETTINGS = [("hybrid", "torch-bf16"), ("hybrid", "fp32"), ("fp16", "fp32"), pytest.param("hybrid", "bf16",
            marks=pytest.mark.skipif(not cpu_has("avx512_bf16"), reason="the compiled bf16 kernel needs AVX512-BF16"))]


@pytest.mark.skipif(not fp16_packing_available(), reason="no FBGEMM fp16 linear in this build/CPU")
@pytest.mark.parametrize("weights, attention", SETTINGS)
def test_a_runner_gives_the_same_logits_with_it_as_without(case, bf16_paths, weights, attention, monkeypatch):
    """A prefill from nothing, a resume after it batched with a second sequence's chunk, a mixed step with a riding
    decode (where the backend attends decode rows in fp32, so the kernel is not used) and a prompt beside a one-token
    prompt, with the kernel and with
    PyTorch's passes, for hybrid matrices (bf16 products) under PyTorch's bf16 attention (bf16 queries) and the
    compiled prefill kernels (fp32 queries), and for packed fp16 matrices (fp32 products) under the compiled fp32 kernel
    (the AVX2-only class's default): bitwise the same logits; the kernel ran for every layer of the all-prefill steps
    (under Qwen3's q/k norms too, which run in PyTorch before it)."""
    runner = ModelRunner(bf16_paths[case.name], dtype="float32", device="cpu", num_blocks=96, weights=weights,
                         prefill_attention=attention, kv_cache_dtype="float16")
    kernel = runner.model.prefill_qkv  # the loaded library's (another test may have had it loaded anew)
    assert isinstance(kernel, prefill_qkv.PrefillQkv)
    counted = Counted(kernel)
    first, second, third, fourth = random_prompts([70, 23, 30, 40], seed=3)
    steps = [[PrefillChunk(first, 0, list(range(5)))],
             [PrefillChunk(second, 70, list(range(6))), PrefillChunk(third, 0, list(range(10, 12)))],
             [PrefillChunk(third[:5], 30, list(range(10, 13))), PrefillChunk([7], 93, list(range(6)))],
             [PrefillChunk(fourth, 0, list(range(20, 23))), PrefillChunk([9], 0, [30])]]
    outs = {}
    for step_kernel in (counted, None):
        monkeypatch.setattr(runner.model, "prefill_qkv", step_kernel)
        runner.kv_cache = runner._new_cache(runner.num_blocks)
        outs[step_kernel is None] = [runner.prefill(s, all_logits=True) for s in steps]
    for with_it, without in zip(outs[False], outs[True], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(with_it, without, strict=True))
    # the last step's one-token prompt is not a bf16 row of hybrid matrices (not every row in bf16: no pass); with
    # packed fp16 matrices the compiled kernel attends the long chunk and PyTorch the one token, both on fp32 queries
    layers = len(runner.model.layers)
    assert counted.calls == (3 if weights == "fp16" else 2) * layers
