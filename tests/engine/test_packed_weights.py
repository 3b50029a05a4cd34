"""Packed fp16 weights (FBGEMM) and hybrid fp16/bf16 weights against transformers on the same weights, and
the format choice on both CPU classes (with and without native bf16)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn.functional as F
import transformers
from engine_helpers import (
    BF16_TOL,
    COMMON,
    MAX_NEW,
    REL_TOL,
    GreedyDriver,
    greedy_generate,
    hf_greedy,
    hf_logits,
    random_prompts,
    rel_err,
)

from agentserve.executor import linear as linear_module
from agentserve.executor import runner as runner_module
from agentserve.executor.errors import EngineError
from agentserve.executor.layer_hook import layer_callback
from agentserve.executor.layers import silu_mul
from agentserve.executor.linear import (
    ALL_ROWS,
    DenseLinear,
    HybridLinear,
    PackedFp16Linear,
    bf16_rows,
    block_bf16_products,
    choose_format,
    cpu_has_amx,
    cpu_has_fast_bf16,
    fp16_packing_available,
    gated_mlp,
    onednn_blocking_available,
    residual_product,
)
from agentserve.executor.runner import DecodeItem, ModelRunner, PrefillChunk, prefill_rows

needs_fbgemm = pytest.mark.skipif(not fp16_packing_available(), reason="no FBGEMM fp16 linear in this build/CPU")
needs_blocking = pytest.mark.skipif(not (fp16_packing_available() and onednn_blocking_available()),
                                    reason="no native bf16 (or FBGEMM) here: hybrid matrices keep F.linear")
F32 = torch.float32
AUTO_16BIT = "hybrid" if cpu_has_fast_bf16() else "fp16"  # what auto makes of a bf16 checkpoint's matrices here


@needs_fbgemm
@pytest.mark.parametrize("rows", [1, 4, 33])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_is_fp16_rounded_weight_in_fp32(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(96, 40, generator=g), torch.randn(rows, 40, generator=g)
    b = torch.randn(96, generator=g) if with_bias else None
    lin = PackedFp16Linear(w, b)
    ref = F.linear(x, w.half().float(), b)
    assert lin(x).dtype == F32 and lin(x).shape == (rows, 96)
    assert torch.allclose(lin(x), ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)  # the weights really are fp16
    assert lin.nbytes == 96 * 40 * 2 + (96 * 4 if with_bias else 0)


def _bf16_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x.bfloat16().float(), w)


@needs_fbgemm
@pytest.mark.parametrize("rows", [1, 16, 200])
def test_hybrid_linear_runs_the_rows_it_is_told_in_bf16_and_the_rest_packed(rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=g).bfloat16().float()  # a bf16 checkpoint's matrix
    b, x = torch.randn(96, generator=g), torch.randn(rows, 40, generator=g)
    lin, packed = HybridLinear(w, b), PackedFp16Linear(w, b)
    assert torch.equal(lin(x), packed(x))  # no rows named: all packed, exactly (lossless weights)
    with bf16_rows(ALL_ROWS):
        got = lin(x)
    ref = _bf16_product(x, w)  # activations and product rounded to bf16, fp32 accumulation; then the bias
    assert got.dtype == F32 and torch.allclose(got - b, ref, rtol=2**-7, atol=2**-7 * ref.abs().max().item())
    assert not torch.allclose(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    half = torch.arange(rows) % 2 == 0
    with bf16_rows(half.nonzero().squeeze(1), (~half).nonzero().squeeze(1)):
        mixed = lin(x)
    with bf16_rows(ALL_ROWS):
        bf16_half = lin(x[half])
    # each group of rows is its own product (bitwise: the same shapes); against the whole batch only closely,
    # since a GEMM's blocking may depend on the row count (it does on AVX2)
    assert torch.equal(mixed[~half], packed(x[~half])) and torch.equal(mixed[half], bf16_half)
    assert torch.allclose(mixed[~half], packed(x)[~half], rtol=1e-5, atol=1e-5 * got.abs().max().item())
    assert torch.allclose(mixed[half], got[half], rtol=2**-7, atol=2**-7 * ref.abs().max().item())
    assert torch.equal(lin(x), packed(x))  # the context ended


@needs_fbgemm
def test_blocked_copies_are_made_for_hybrid_matrices_only_all_or_none_within_the_budget(monkeypatch):
    g = torch.Generator().manual_seed(5)
    hybrid = [HybridLinear(torch.randn(n, 32, generator=g).bfloat16().float(), None) for n in (48, 16)]
    dense = DenseLinear(torch.randn(8, 32, generator=g), None)
    size = sum(x.weight16.nbytes for x in hybrid)
    assert block_bf16_products([*hybrid, dense], size - 1) == 0 and all(x.blocked is None for x in hybrid)
    monkeypatch.setattr(linear_module, "onednn_blocking_available", lambda: False)  # an AVX2-only CPU
    assert block_bf16_products([*hybrid, dense], size) == 0 and all(x.blocked is None for x in hybrid)
    monkeypatch.undo()
    if onednn_blocking_available():
        assert block_bf16_products([*hybrid, dense], size) == size
        assert all(x.blocked is not None for x in hybrid) and not hasattr(dense, "blocked")


@pytest.mark.skipif(not (cpu_has_amx() and onednn_blocking_available()), reason="measured on AMX only")
@pytest.mark.parametrize("rows", [1, 56, 64, 300])
def test_on_amx_one_thread_the_blocked_product_is_bitwise_f_linears(rows):
    """The layout is made for 64 rows: laid out for one row, oneDNN's AMX products of ~56 rows and more round
    otherwise than ``F.linear`` (the same sums in another order); for 64 they are the same bits on one thread."""
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(1408, 512, generator=g).bfloat16(), torch.randn(rows, 512, generator=g).bfloat16()
    lin = HybridLinear(w.float(), None)
    block_bf16_products([lin], lin.weight16.nbytes)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(lin.bf16_product(x), F.linear(x, w))
    finally:
        torch.set_num_threads(threads)


@needs_blocking
@pytest.mark.parametrize("rows", [1, 7, 56, 64, 300])
def test_a_blocked_hybrid_matrix_multiplies_its_bf16_rows_from_the_blocked_copy(rows):
    """The blocked copy is what the bf16 rows read (a zeroed row-major matrix changes nothing), and its product is
    the bf16 product of the same values: within two bf16 roundings of ``F.linear``'s (their sums' order may differ)."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(160, 96, generator=g).bfloat16().float()
    b, x = torch.randn(160, generator=g), torch.randn(rows, 96, generator=g)
    lin = HybridLinear(w, b)
    assert block_bf16_products([lin], lin.weight16.nbytes) == lin.weight16.nbytes
    ref = F.linear(x.bfloat16(), w.bfloat16()).float()
    lin.weight16 = torch.zeros_like(lin.weight16)
    with bf16_rows(ALL_ROWS):
        got = lin(x)
        product = lin.bf16_product(x)
    assert product.dtype == torch.bfloat16 and torch.equal(got, product.float() + b)
    assert torch.allclose(product.float(), ref, rtol=2**-7, atol=2**-7 * ref.abs().max().item())
    assert torch.equal(lin(x), PackedFp16Linear(w, b)(x))  # decode rows: the packed product, untouched


@pytest.mark.parametrize("native_bf16", [False, True])
@pytest.mark.parametrize("blocked", [False, True])
def test_bf16_products_of_more_than_8_rows_run_padded_to_a_multiple_where_the_cpu_has_native_bf16(
        blocked, native_bf16, monkeypatch):
    """Where oneDNN runs bf16 natively (it builds a kernel per row count it meets) row counts above ``PRODUCT_ROWS``
    reach it rounded up to a multiple of it, fewer as they are; elsewhere every count as it is.  The padding's rows
    are dropped and each row's result is its own product (rows are independent)."""
    if blocked and not onednn_blocking_available():
        pytest.skip("no oneDNN-blocked bf16 products on this CPU")
    monkeypatch.setattr(linear_module, "cpu_has_fast_bf16", lambda: native_bf16)
    seen: list[int] = []
    where, name = (linear_module, "_blocked_product") if blocked else (F, "linear")
    monkeypatch.setattr(where, name, _Spy(getattr(where, name), seen))
    g = torch.Generator().manual_seed(5)
    w = torch.randn(96, 64, generator=g).bfloat16().float()
    lin = HybridLinear(w, None)
    if blocked:
        block_bf16_products([lin], lin.weight16.nbytes)
    dense = DenseLinear(w.bfloat16(), None)
    counts = (1, 7, 8, 13, 56, 61)
    for rows in counts:
        x = torch.randn(rows, 64, generator=g)
        got, got_dense = lin.bf16_product(x), dense(x.bfloat16())
        ref = x.bfloat16().float() @ w.bfloat16().float().T
        for y in (got, got_dense):
            assert y.shape == (rows, 96)
            assert torch.allclose(y.float(), ref, rtol=2**-7, atol=2**-7 * ref.abs().max().item())
    step = linear_module.PRODUCT_ROWS
    expect = [n if n <= step or not native_bf16 else -(-n // step) * step for n in counts]
    assert seen == [n for n in expect for _ in range(1 if blocked else 2)], seen


class _Spy:
    def __init__(self, product, seen: list[int]) -> None:
        self.product, self.seen = product, seen

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        self.seen.append(x.shape[0])
        return self.product(x, *args, **kwargs)


KERNEL_BUILDS = """
import torch
from agentserve.executor.linear import HybridLinear, block_bf16_products
torch.set_num_threads(1)
lin = HybridLinear(torch.randn(256, 128), None)
block_bf16_products([lin], lin.weight16.nbytes)
for rows in range(1, 65):
    lin.bf16_product(torch.randn(rows, 128))
"""


@needs_blocking
def test_products_of_64_row_counts_build_a_kernel_per_padded_count_only():
    """oneDNN's own account (its verbose log of kernel builds): products of 1..64 rows build one inner-product
    kernel per count up to ``PRODUCT_ROWS`` and one per multiple of it above, not one per row count."""
    env = {**os.environ, "ONEDNN_VERBOSE": "profile_create"}
    done = subprocess.run([sys.executable, "-c", KERNEL_BUILDS], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    builds = [line for line in done.stdout.splitlines() if "create:cache_miss" in line and "ic128oc256" in line]
    step = linear_module.PRODUCT_ROWS
    assert len(builds) == (step - 1) + 64 // step, builds


def test_blocked_bf16_products_are_available_wherever_pytorch_multiplies_on_amx_tiles():
    """On AMX the blocked copies must not switch themselves off unnoticed (a renamed private op would skip the
    tests below): the CPU class the oneDNN-blocked products were measured on."""
    if cpu_has_amx() and fp16_packing_available():
        assert onednn_blocking_available()


@needs_blocking
def test_a_hybrid_runner_blocks_its_layer_matrices_exactly_within_its_ram_share(bf16_checkpoints, monkeypatch):
    path, _ = bf16_checkpoints["qwen2_tied_bias"]
    runner = ModelRunner(path, dtype="float32", device="cpu", num_blocks=8, weights="hybrid")
    matrices = [getattr(layer, n) for layer in runner.model.layers for n in ("qkv", "o", "gate_up", "down")]
    assert runner.blocked_bytes == sum(m.weight16.nbytes for m in matrices) > 0
    assert all(torch.equal(m.blocked.to_dense(), m.weight16) for m in matrices)  # the same values, laid out anew
    assert runner.model.lm_head.blocked is None  # a prefill's logits take the packed product
    monkeypatch.setattr(runner_module, "BLOCKED_RAM_SHARE", 0.0)
    runner = ModelRunner(path, dtype="float32", device="cpu", num_blocks=8, weights="hybrid")
    assert runner.blocked_bytes == 0 and all(layer.o.blocked is None for layer in runner.model.layers)


@needs_fbgemm
@pytest.mark.parametrize("rows", [3, 64])
def test_gated_mlp_keeps_bf16_rows_in_bf16_between_its_products(rows):
    """The bf16 rows of hybrid matrices take SwiGLU on the bf16 gate/up product (no fp32 round trip); the
    other rows of a mixed step take the packed path in fp32; with biases, or with dense matrices, it is the
    plain composition."""
    g = torch.Generator().manual_seed(rows)
    wgu, wd = (torch.randn(*shape, generator=g).bfloat16().float() for shape in ((2 * 48, 40), (40, 48)))
    x = torch.randn(rows, 40, generator=g)
    gate_up, down = HybridLinear(wgu, None), HybridLinear(wd, None)
    plain = down(silu_mul(gate_up(x)))
    assert torch.equal(gated_mlp(gate_up, down, x), plain)  # no bf16 rows named: all packed
    ref = F.linear(silu_mul(F.linear(x.bfloat16(), wgu.bfloat16())), wd.bfloat16()).float()
    with bf16_rows(ALL_ROWS):
        got = gated_mlp(gate_up, down, x)
        through_fp32 = down(silu_mul(gate_up(x)))
        bf16_half = gated_mlp(gate_up, down, x[torch.arange(rows) % 2 == 0])
    assert got.dtype == bf16_half.dtype == torch.bfloat16  # left for the residual add, which widens it exactly
    got, bf16_half = got.float(), bf16_half.float()
    assert torch.equal(got, ref) and not torch.equal(got, through_fp32)  # SwiGLU's bf16 rounding is visible
    half = torch.arange(rows) % 2 == 0
    with bf16_rows(half.nonzero().squeeze(1), (~half).nonzero().squeeze(1)):
        mixed = gated_mlp(gate_up, down, x)
    packed_half = down(silu_mul(gate_up(x[~half])))
    assert torch.equal(mixed[half], bf16_half) and torch.equal(mixed[~half], packed_half)
    assert torch.allclose(mixed[half], got[half], rtol=2**-6, atol=2**-6 * ref.abs().max().item())
    assert torch.allclose(mixed[~half], plain[~half], rtol=1e-5, atol=1e-5 * plain.abs().max().item())
    biased = HybridLinear(wgu, torch.randn(2 * 48, generator=g))
    with bf16_rows(ALL_ROWS):
        assert torch.equal(gated_mlp(biased, down, x), down(silu_mul(biased(x))))


@needs_fbgemm
def test_a_residual_product_is_left_in_bf16_only_where_its_values_are_bf16():
    """Every row in bf16 on a bias-less hybrid matrix: the bf16 product itself (what ``linear`` widens); with a bias,
    rows named among others, none named, or a dense matrix: ``linear(x)``; a residual added in place widens it to the
    same bits as adding ``linear(x)``."""
    g = torch.Generator().manual_seed(7)
    w, x = torch.randn(24, 40, generator=g).bfloat16().float(), torch.randn(9, 40, generator=g)
    residual = torch.randn(9, 24, generator=g)
    plain, biased, dense = HybridLinear(w, None), HybridLinear(w, torch.randn(24, generator=g)), DenseLinear(w, None)
    with bf16_rows(ALL_ROWS):
        got = residual_product(plain, x)
        assert got.dtype == torch.bfloat16 and torch.equal(got.float(), plain(x))
        assert torch.equal(residual.clone().add_(got), residual + plain(x))
        for other in (biased, dense):
            assert torch.equal(residual_product(other, x), other(x)) and residual_product(other, x).dtype == F32
    with bf16_rows(torch.tensor([0, 2]), torch.tensor([1, 3, 4, 5, 6, 7, 8])):
        assert torch.equal(residual_product(plain, x), plain(x))
    assert torch.equal(residual_product(plain, x), plain(x)) and residual_product(plain, x).dtype == F32


@needs_fbgemm
def test_the_bf16_rows_belong_to_the_thread_that_named_them():
    w, x = torch.randn(64, 32).bfloat16().float(), torch.randn(20, 32)
    lin = HybridLinear(w, None)
    inside, outside = threading.Event(), threading.Event()
    seen = {}

    def other_thread() -> None:
        inside.wait(10)
        seen["other"] = lin(x)
        outside.set()

    worker = threading.Thread(target=other_thread)
    worker.start()
    with bf16_rows(ALL_ROWS):
        inside.set()
        outside.wait(10)
        seen["named"] = lin(x)
    worker.join()
    assert torch.equal(seen["other"], PackedFp16Linear(w, None)(x)) and not torch.equal(seen["named"], seen["other"])


def test_prefill_rows_are_the_rows_of_chunks_longer_than_one_token():
    assert prefill_rows([5, 3]) == (ALL_ROWS, None) and prefill_rows([1, 1]) == (None, None)
    rows, others = prefill_rows([1, 3, 1, 2])
    assert rows.tolist() == [1, 2, 3, 5, 6] and others.tolist() == [0, 4]


@needs_fbgemm
def test_bf16_checkpoint_runs_packed_and_matches_transformers(case, bf16_checkpoints):
    """Packed matrices over the exact (fp32) KV cache: transformers' greedy tokens and logits."""
    path, hf = bf16_checkpoints[case.name]
    runner = ModelRunner(path, dtype="float32", device="cpu", num_blocks=64, weights="fp16", kv_cache_dtype="float32")
    assert runner.weight_format == "fp16"  # 16-bit matrices on an fp32 CPU runner, packed
    assert runner.model.embed.dtype == torch.bfloat16  # the lookup table stays as stored (tied or not)
    assert greedy_generate(runner, case.prompts, MAX_NEW) == [hf_greedy(hf, p, MAX_NEW) for p in case.prompts]
    a, b = case.prompts[3], case.prompts[1]
    driver = GreedyDriver(runner, 2)
    driver.prefill([0, 1], [a[:50], b])
    got = runner.prefill([PrefillChunk(a[50:], 50, driver.tables[0])], all_logits=True)[0]
    assert rel_err(got, hf_logits(hf, a)[50:]) < REL_TOL
    dec = runner.decode([DecodeItem(7, len(a), driver.tables[0]), DecodeItem(9, len(b), driver.tables[1])])
    assert rel_err(dec[0], hf_logits(hf, a + [7])[-1]) < REL_TOL
    assert rel_err(dec[1], hf_logits(hf, b + [9])[-1]) < REL_TOL


@needs_fbgemm
def test_forced_fp16_on_fp32_checkpoint_matches_fp16_rounded_transformers(cases):
    case = cases["llama3_untied"]  # untied: the embedding lookup stays fp32, the lm_head is packed
    rounded = copy.deepcopy(case.hf)
    with torch.no_grad():
        for name, p in rounded.named_parameters():
            if "proj.weight" in name or "lm_head" in name:
                p.copy_(p.half().float())
    runner = ModelRunner(case.path, dtype="float32", device="cpu", num_blocks=8, weights="fp16",
                         kv_cache_dtype="float32")  # the exact cache: only the matrices are rounded
    assert runner.weight_format == "fp16"
    tokens = case.prompts[3]
    got = runner.prefill([PrefillChunk(tokens, 0, list(range(8)))], all_logits=True)[0]
    assert rel_err(got, hf_logits(rounded, tokens)) < REL_TOL
    assert rel_err(got, hf_logits(case.hf, tokens)) > REL_TOL  # fp16 rounding is visible: the test can fail


@needs_fbgemm
def test_hybrid_runner_decodes_exactly_and_prefills_within_bf16_tolerance(case, bf16_checkpoints):
    """``weights = hybrid`` (``auto``'s choice on CPUs with native bf16; forced here on either class): every
    decode token takes the packed product, so a prompt fed one token per step generates exactly what
    transformers does; a prefill chunk runs bf16 products, its logits within ``BF16_TOL``."""
    path, hf = bf16_checkpoints[case.name]
    runner = ModelRunner(path, dtype="float32", device="cpu", num_blocks=64, weights="hybrid")
    assert runner.weight_format == "hybrid" and runner.dtype == F32
    prompt = case.prompts[1]
    driver = GreedyDriver(runner, 1)
    for token in prompt[:-1]:
        driver.decode([0], [token])
    logits = driver.decode([0], [prompt[-1]])
    assert driver.generate([0], logits, 16) == [hf_greedy(hf, prompt, 16)]
    long = case.prompts[3]
    got = runner.prefill([PrefillChunk(long, 0, list(range(32, 40)))], all_logits=True)[0]
    assert REL_TOL < rel_err(got, hf_logits(hf, long)) < BF16_TOL  # the bf16 products are visible, and small


@needs_fbgemm
def test_a_hybrid_sequence_computes_the_same_whatever_it_is_batched_with(bf16_checkpoints):
    """Rows go to bf16 by the chunk they belong to, not by the batch's size: a chunk's logits are bitwise the
    same alone, beside another chunk, and beside one-token (decode) rows in the same step.  (Small chunks: on AMX
    oneDNN's bf16 products round differently once a batch has some hundreds of rows — docs/executor.md.)"""
    path, _ = bf16_checkpoints["qwen2_tied_bias"]
    runner = ModelRunner(path, dtype="float32", device="cpu", num_blocks=64, weights="hybrid")
    a, b = random_prompts([23, 40], seed=11)
    alone = runner.prefill([PrefillChunk(a, 0, list(range(8)))], all_logits=True)[0]
    pair = runner.prefill([PrefillChunk(b, 0, list(range(8, 16))), PrefillChunk(a, 0, list(range(8)))],
                          all_logits=True)[1]
    runner.prefill([PrefillChunk(b[:5], 0, list(range(16, 24)))])
    mixed = runner.prefill([PrefillChunk([b[5]], 5, list(range(16, 24))), PrefillChunk(a, 0, list(range(8)))],
                           all_logits=True)[1]
    assert torch.equal(alone, pair) and torch.equal(alone, mixed)


@needs_fbgemm
@pytest.mark.parametrize("outer", ["chunk", "chunk beside a one-token row"])
def test_a_prefill_run_inside_another_at_a_layer_boundary_computes_as_alone(bf16_checkpoints, outer):
    """A preempting step runs inside the lane's running step, at a layer boundary (``LaneWorker.run_preempting``):
    its logits took the running step's bf16 rows — another batch's — an IndexError beside a one-token row, the bf16
    product of its head otherwise.  Both steps now compute bitwise as each does alone."""
    path, _ = bf16_checkpoints["qwen2_tied_bias"]
    runner = ModelRunner(path, dtype="float32", device="cpu", num_blocks=64, weights="hybrid")
    a, b, c = random_prompts([23, 40, 9], seed=12)
    runner.prefill([PrefillChunk(b[:5], 0, list(range(16, 24)))])
    steps = [PrefillChunk(a, 0, list(range(8)))]
    if outer != "chunk":
        steps.insert(0, PrefillChunk([b[5]], 5, list(range(16, 24))))
    inner = [PrefillChunk(c, 0, list(range(40, 48))), PrefillChunk(b[:7], 0, list(range(48, 56)))]
    inner_alone, outer_alone = runner.prefill(inner), runner.prefill(steps)
    nested: list[torch.Tensor] = []

    def preempt() -> None:
        if not nested:
            with layer_callback(None):  # one level, as a lane runs it
                nested.append(runner.prefill(inner))

    with layer_callback(preempt):
        outer_nested = runner.prefill(steps)
    assert torch.equal(nested[0], inner_alone) and torch.equal(outer_nested, outer_alone)


def test_auto_keeps_fp32_checkpoints_and_bf16_runners_dense(cases, bf16_checkpoints):
    case = cases["llama_tied"]
    dense = ModelRunner(case.path, dtype="float32", device="cpu", num_blocks=2)
    assert dense.weight_format == "dense"
    assert dense.model.lm_head.weight is dense.model.embed  # tied and dense: one tensor
    path, _ = bf16_checkpoints[case.name]
    tied = ModelRunner(path, dtype="float32", device="cpu", num_blocks=2, weights="dense")
    assert tied.weight_format == "dense" and tied.model.lm_head.weight is tied.model.embed  # one fp32 table
    assert ModelRunner(path, dtype="bfloat16", device="cpu", num_blocks=2).weight_format == "dense"


def test_untied_dense_runner_looks_up_a_bf16_table_exactly(bf16_checkpoints):
    """Untied, weights dense: the table stays bf16 (rows widened on lookup) and logits match transformers."""
    path, hf = bf16_checkpoints["llama3_untied"]
    runner = ModelRunner(path, dtype="float32", device="cpu", num_blocks=8, weights="dense")
    assert runner.model.embed.dtype == torch.bfloat16 and runner.model.lm_head.weight.dtype == F32
    tokens = random_prompts([40], seed=6)[0]
    got = runner.prefill([PrefillChunk(tokens, 0, list(range(8)))], all_logits=True)[0]
    assert rel_err(got, hf_logits(hf, tokens)) < REL_TOL


def test_auto_keeps_values_outside_fp16_range_dense():
    big, small = torch.tensor([[1.0, 70000.0]]), torch.tensor([[1.0, 60000.0]])
    expected = AUTO_16BIT if fp16_packing_available() else "dense"
    assert choose_format("auto", torch.bfloat16, big) == "dense"
    assert choose_format("auto", torch.bfloat16, small) == expected
    assert choose_format("auto", torch.float16, small) == ("fp16" if fp16_packing_available() else "dense")
    assert choose_format("auto", torch.float32, small) == "dense"  # an fp32 checkpoint is not rounded
    assert choose_format("auto", torch.bfloat16, small.bfloat16()) == "dense"  # a bf16 runner
    assert choose_format("dense", torch.bfloat16, small) == "dense"
    with pytest.raises(EngineError, match="unknown weights setting"):
        choose_format("int4", torch.bfloat16, small)


@needs_fbgemm
def test_packed_llama_with_attention_and_mlp_biases_matches_transformers(tmp_path):
    config = transformers.LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True)
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15)
    model.save_pretrained(tmp_path / "biases")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "biases", dtype=torch.float32).eval()
    runner = ModelRunner(tmp_path / "biases", dtype="float32", device="cpu", num_blocks=8, weights="fp16",
                         kv_cache_dtype="float32")
    assert runner.weight_format == "fp16" and runner.model.embed.dtype == torch.bfloat16  # no wide copy kept
    tokens = random_prompts([40], seed=5)[0]
    got = runner.prefill([PrefillChunk(tokens, 0, list(range(8)))], all_logits=True)[0]
    assert rel_err(got, hf_logits(hf, tokens)) < REL_TOL


def test_bad_weight_format_or_cache_type_is_a_clear_error(cases):
    path = cases["llama_tied"].path
    with pytest.raises(EngineError, match="unknown weights setting"):
        ModelRunner(path, dtype="float32", device="cpu", num_blocks=2, weights="int4")
    with pytest.raises(EngineError, match="float32"):
        ModelRunner(path, dtype="bfloat16", device="cpu", num_blocks=2, weights="fp16")
    with pytest.raises(EngineError, match="unknown kv_cache_dtype"):
        ModelRunner(path, dtype="float32", device="cpu", num_blocks=2, kv_cache_dtype="int8")
    with pytest.raises(EngineError, match="only the model dtype"):
        ModelRunner(path, dtype="bfloat16", device="cpu", num_blocks=2, kv_cache_dtype="float16")
