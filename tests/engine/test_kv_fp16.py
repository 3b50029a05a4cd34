"""The fp16 KV cache on a CPU (``kv_cache_dtype``): what ``auto`` picks, the compiled kernel over fp16 caches
against float64 attention, and the runner against transformers within the rounding of K/V to fp16."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from engine_helpers import REL_TOL, GreedyDriver, hf_logits, random_prompts, rel_err
from hypothesis import given, settings
from hypothesis import strategies as st
from test_paged_decode_kernel import random_case, reference

from agentserve.executor.attention import cpu_kernel
from agentserve.executor.kernels import build
from agentserve.executor.linear import fp16_packing_available
from agentserve.executor.runner import DecodeItem, ModelRunner, PrefillChunk

KERNEL = cpu_kernel.load() if build.compiler() is not None else None
reads_f16 = pytest.mark.skipif(KERNEL is None or not KERNEL.reads_f16, reason="no kernel reading fp16 caches here")
needs_fbgemm = pytest.mark.skipif(not fp16_packing_available(), reason="no FBGEMM fp16 linear in this build/CPU")
KV_TOL = 3e-3  # logits with K/V rounded to fp16 (11 significant bits) against the fp32 reference


@pytest.fixture(scope="module")
def bf16_checkpoint(cases, tmp_path_factory):
    """One case saved in bf16, and transformers on it in fp32."""
    case = cases["qwen2_tied_bias"]
    path = tmp_path_factory.mktemp("bf16_kv") / case.name
    copy.deepcopy(case.hf).to(torch.bfloat16).save_pretrained(path)
    return path, transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), case


@reads_f16
@settings(max_examples=40, deadline=None)
@given(kv_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 3, 4]), dim=st.sampled_from([8, 12, 64]),
       block_size=st.sampled_from([1, 7, 16]), lens=st.lists(st.integers(1, 150), min_size=1, max_size=4),
       seed=st.integers(0, 2**16), shared=st.integers(0, 6))
def test_kernel_over_fp16_caches_equals_float64_attention(kv_heads, group, dim, block_size, lens, seed, shared):
    q, k_cache, v_cache, tables, lens_t = random_case(kv_heads, group, dim, block_size, lens, 1.0, seed, shared)
    k16, v16 = k_cache.half(), v_cache.half()
    got = KERNEL(q, k16, v16, tables, lens_t, dim**-0.5)
    want = reference(q, k16.float(), v16.float(), tables, lens_t, dim**-0.5)  # the same fp16 values, in float64
    assert torch.allclose(got.double(), want, atol=2e-5, rtol=1e-4)


@reads_f16
def test_kernel_reads_each_cache_type_with_its_own_walk():
    q, k_cache, v_cache, tables, lens = random_case(2, 4, 64, 16, [300, 170, 100], 1.0, seed=3, shared=3)
    k16, v16 = k_cache.half(), v_cache.half()
    from_f16 = KERNEL(q, k16, v16, tables, lens, 0.125)
    widened = KERNEL(q, k16.float(), v16.float(), tables, lens, 0.125)  # the same values through the fp32 walk
    assert torch.allclose(from_f16, widened, atol=1e-6, rtol=1e-6)
    exact = KERNEL(q, k_cache, v_cache, tables, lens, 0.125)
    assert (from_f16 - exact).abs().max() > 100 * (from_f16 - widened).abs().max()  # the rounding is real
    with pytest.raises(ValueError, match="contiguous CPU"):
        KERNEL(q, k16.bfloat16(), v16.bfloat16(), tables, lens, 0.125)


@reads_f16
@needs_fbgemm
def test_auto_picks_fp16_for_packed_16_bit_matrices_only(cases, bf16_checkpoint):
    path, _, _ = bf16_checkpoint
    assert ModelRunner(path, dtype="float32", device="cpu", num_blocks=2).kv_dtype == torch.float16
    assert ModelRunner(path, dtype="float32", device="cpu", num_blocks=2, weights="dense").kv_dtype == torch.float32
    assert ModelRunner(path, dtype="float32", device="cpu", num_blocks=2, attention_backend="torch").kv_dtype \
        == torch.float32  # the PyTorch decode path would widen every gathered block: no gain
    fp32_ckpt = cases["llama_tied"].path  # an fp32 checkpoint: dense matrices, the exact cache
    assert ModelRunner(fp32_ckpt, dtype="float32", device="cpu", num_blocks=2).kv_dtype == torch.float32
    assert ModelRunner(path, dtype="bfloat16", device="cpu", num_blocks=2).kv_dtype == torch.bfloat16
    half = ModelRunner(path, dtype="float32", device="cpu", num_blocks=2, kv_cache_dtype="float32")
    assert half.kv_dtype == torch.float32 and half.kv_cache.k[0].dtype == torch.float32


@needs_fbgemm
@pytest.mark.parametrize("attention", ["auto", "torch"])
def test_fp16_cache_runner_matches_transformers_within_the_rounding(bf16_checkpoint, attention):
    """Packed matrices over an fp16 cache, through the compiled kernel and through PyTorch: prefill, a resume
    after a cached prefix and a decode batch, each within ``KV_TOL`` of transformers (and the rounding visible)."""
    path, hf, case = bf16_checkpoint
    if attention == "auto" and (KERNEL is None or not KERNEL.reads_f16):
        pytest.skip("no kernel reading fp16 caches here")
    runner = ModelRunner(path, dtype="float32", device="cpu", num_blocks=64, weights="fp16", kv_cache_dtype="float16",
                         attention_backend=attention)
    assert runner.kv_cache.k[0].dtype == torch.float16
    a, b = case.prompts[3], case.prompts[1]
    driver = GreedyDriver(runner, 2)
    driver.prefill([0, 1], [a[:50], b])
    got = runner.prefill([PrefillChunk(a[50:], 50, driver.tables[0])], all_logits=True)[0]
    errors = [rel_err(got, hf_logits(hf, a)[50:])]
    dec = runner.decode([DecodeItem(7, len(a), driver.tables[0]), DecodeItem(9, len(b), driver.tables[1])])
    errors += [rel_err(dec[0], hf_logits(hf, a + [7])[-1]), rel_err(dec[1], hf_logits(hf, b + [9])[-1])]
    assert max(errors) < KV_TOL and max(errors) > REL_TOL, errors


@reads_f16
@needs_fbgemm
def test_the_kernel_and_pytorch_decode_an_fp16_cache_alike(bf16_checkpoint):
    path, _, _ = bf16_checkpoint
    prompts = random_prompts([30, 70, 45], seed=5)
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(3)]
    out = {}
    for attention in ("auto", "torch"):
        runner = ModelRunner(path, dtype="float32", device="cpu", num_blocks=32, weights="fp16",
                             kv_cache_dtype="float16", attention_backend=attention)
        runner.prefill([PrefillChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
        out[attention] = runner.decode([DecodeItem(3, len(p), t) for p, t in zip(prompts, tables, strict=True)])
    assert rel_err(out["auto"], out["torch"]) < 1e-5
