"""The fused CPU decode step (``executor/fused``) against the PyTorch decode step on the same runner's weights,
on every architecture case and on shapes that take its tail loops; its refusals and its setting."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from engine_helpers import COMMON, REL_TOL, GreedyDriver, rel_err, save_checkpoint

from agentserve.executor.attention import cpu_kernel
from agentserve.executor.errors import EngineError
from agentserve.executor.fused.step import rows16
from agentserve.executor.linear import HybridLinear, PackedFp16Linear, fp16_packing_available
from agentserve.executor.runner import DecodeItem, ModelRunner


def _fused_runs_here() -> bool:
    if not fp16_packing_available() or cpu_kernel._compiler() is None:
        return False
    kernel = cpu_kernel.load()
    return kernel is not None and bool(kernel.library.fused_decode_available())


pytestmark = pytest.mark.skipif(not _fused_runs_here(), reason="no FBGEMM, C compiler or AVX2+FMA+F16C here")


@pytest.fixture(scope="module")
def bf16_paths(cases, tmp_path_factory):
    root, out = tmp_path_factory.mktemp("fused_bf16"), {}
    for name, case in cases.items():
        copy.deepcopy(case.hf).to(torch.bfloat16).save_pretrained(root / name)
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def odd_path(tmp_path_factory):
    """A Qwen2 (q/k/v biases) whose sizes are no multiple of 16 or 4: hidden 66 in three heads of 22 and one
    KV head (the biased q/k/v product has 110 rows), intermediate 149 (298 gate/up rows, 149 columns in the
    down product), so every tail loop of the products runs."""
    config = transformers.Qwen2Config(**{**COMMON, "hidden_size": 66, "num_attention_heads": 3,
                                         "num_key_value_heads": 1, "intermediate_size": 149})
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return save_checkpoint(model.to(torch.bfloat16), tmp_path_factory.mktemp("fused_odd") / "qwen2_odd")


def _decode_logits(runner: ModelRunner, prompts: list[list[int]], steps: int, threads: int) -> torch.Tensor:
    """Logits of ``steps`` greedy decode steps of all ``prompts`` batched, after prefilling them."""
    driver = GreedyDriver(runner, len(prompts))
    seqs = list(range(len(prompts)))
    logits = driver.prefill(seqs, prompts)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = []
        for _ in range(steps):
            logits = driver.decode(seqs, logits.argmax(-1).tolist())
            out.append(logits)
    finally:
        torch.set_num_threads(before)
    return torch.stack(out)


def _pair(path, **kwargs) -> tuple[ModelRunner, ModelRunner]:
    fused = ModelRunner(path, device="cpu", dtype="float32", num_blocks=48, decode_step="fused", **kwargs)
    torch_ = ModelRunner(path, device="cpu", dtype="float32", num_blocks=48, decode_step="torch", **kwargs)
    assert fused.fused_decode is not None and torch_.fused_decode is None
    return fused, torch_


@pytest.mark.parametrize("weights,kv", [("fp16", "float16"), ("hybrid", "float32")])
def test_fused_step_matches_the_pytorch_step_on_every_architecture(case, bf16_paths, weights, kv):
    """Three sequences (an odd batch: the last takes the products' single-sequence path), on one and two threads."""
    fused, torch_ = _pair(bf16_paths[case.name], weights=weights, kv_cache_dtype=kv)
    prompts = case.prompts[:3]
    ref = _decode_logits(torch_, prompts, 8, threads=1)
    for threads in (1, 2):
        got = _decode_logits(fused, prompts, 8, threads)
        assert rel_err(got, ref) < REL_TOL
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert rel_err(got, ref) > 0  # two different paths: the comparison is not of one path with itself


def test_fused_step_takes_sizes_that_are_no_multiple_of_its_vectors(odd_path, cases):
    fused, torch_ = _pair(odd_path, weights="fp16")
    prompts = cases["qwen2_tied_bias"].prompts
    assert rel_err(_decode_logits(fused, prompts, 6, 2), _decode_logits(torch_, prompts, 6, 1)) < REL_TOL


def test_a_block_outside_the_cache_is_refused_before_anything_is_written(bf16_paths):
    runner = ModelRunner(bf16_paths["llama_tied"], device="cpu", dtype="float32", num_blocks=8, weights="fp16")
    step = runner.fused_decode
    before = [t.clone() for t in (*runner.kv_cache.k, *runner.kv_cache.v)]
    one = torch.tensor([0], dtype=torch.int64)
    for tables, lens, slots in (([[8]], [1], [0]), ([[0]], [17], [0]), ([[0]], [1], [8 * 16])):
        with pytest.raises(EngineError, match="outside"):
            step(torch.tensor([5]), one, torch.tensor(slots), torch.tensor(tables), torch.tensor(lens),
                 runner.kv_cache, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, (*runner.kv_cache.k, *runner.kv_cache.v), strict=True))
    with pytest.raises(EngineError, match="outside"):  # the position is checked too (beyond the rotary table)
        step(torch.tensor([5]), torch.tensor([10_000]), torch.tensor([0]), torch.tensor([[0]]), torch.tensor([1]),
             runner.kv_cache, 1)
    runner.decode([DecodeItem(5, 0, [0])])  # and the step still works afterwards


def test_decode_step_setting(cases, bf16_paths):
    with pytest.raises(EngineError, match="dense"):  # an fp32 checkpoint's matrices stay dense under auto
        ModelRunner(cases["llama_tied"].path, device="cpu", num_blocks=8, decode_step="fused")
    assert ModelRunner(cases["llama_tied"].path, device="cpu", num_blocks=8).fused_decode is None
    with pytest.raises(EngineError, match="decode_step"):
        ModelRunner(bf16_paths["llama_tied"], device="cpu", num_blocks=8, decode_step="fast")
    with pytest.raises(EngineError, match="paged-decode kernel"):
        ModelRunner(bf16_paths["llama_tied"], device="cpu", num_blocks=8, attention_backend="torch",
                    decode_step="fused")
    assert ModelRunner(bf16_paths["llama_tied"], device="cpu", num_blocks=8).fused_decode is not None  # auto


def test_rows16_shares_a_bf16_checkpoints_hybrid_matrix_and_unpacks_the_rest_exactly():
    w = (torch.randn(12, 40) * 0.1).bfloat16().float()
    bias = torch.randn(12)
    hybrid = HybridLinear(w, bias, stored=torch.bfloat16)
    got, got_bias = rows16(hybrid)
    assert got.data_ptr() == hybrid.weight16.data_ptr() and torch.equal(got_bias, bias)
    for linear in (PackedFp16Linear(w, bias), HybridLinear(w, bias, stored=torch.float16)):
        got, got_bias = rows16(linear)
        assert got.dtype == torch.float16 and torch.equal(got.float(), w) and torch.equal(got_bias, bias)
