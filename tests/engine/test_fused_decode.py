"""The fused CPU decode step (``executor/fused``) against the PyTorch decode step on the same runner's weights,
on every architecture case and on shapes that take its tail loops; its refusals and its setting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch
from engine_helpers import REL_TOL, GreedyDriver, fused_runs_here, random_bf16_qwen2, rel_err

from agentserve.executor.errors import EngineError
from agentserve.executor.fused.arena import HugePageArena, aligned
from agentserve.executor.fused.step import MATRICES, rows16
from agentserve.executor.kernels import build
from agentserve.executor.linear import HybridLinear, PackedFp16Linear
from agentserve.executor.runner import DecodeItem, ModelRunner

pytestmark = pytest.mark.skipif(not fused_runs_here(), reason="no FBGEMM, C compiler or AVX2+FMA+F16C here")


@pytest.fixture(scope="module")
def odd_path(tmp_path_factory):
    """A Qwen2 (q/k/v biases) whose sizes are no multiple of 16 or 4: hidden 66 in three heads of 22 and one
    KV head (the biased q/k/v product has 110 rows), intermediate 149 (298 gate/up rows, 149 columns in the
    down product), so every tail loop of the products runs."""
    return random_bf16_qwen2(tmp_path_factory.mktemp("fused_odd") / "qwen2_odd", 3, 0.15, hidden_size=66,
                             num_attention_heads=3, num_key_value_heads=1, intermediate_size=149)


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


def test_two_lanes_may_run_fused_decode_batches_at_once(bf16_paths, cases):
    """The decode and prefill lanes are threads over one runner: concurrent fused steps on different sequences
    compute what they compute one after another."""
    runner = ModelRunner(bf16_paths["qwen3_headdim"], device="cpu", dtype="float32", num_blocks=48, weights="fp16")
    prompts = cases["qwen3_headdim"].prompts
    driver = GreedyDriver(runner, 4)
    first = driver.prefill([0, 1, 2, 3], prompts).argmax(-1).tolist()
    items = [DecodeItem(first[s], driver.cached[s], driver.tables[s]) for s in range(4)]
    alone = [runner.decode(items[:2]), runner.decode(items[2:])]
    results: dict[int, list[torch.Tensor]] = {0: [], 1: []}

    def lane(i: int) -> None:
        for _ in range(30):  # each step rewrites the same slot with the same K/V: the results must not move
            results[i].append(runner.decode(items[2 * i:2 * i + 2]))

    threads = [threading.Thread(target=lane, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(got, alone[i]) for i in (0, 1) for got in results[i])


def test_hybrid_matrices_move_into_the_arena_and_fp16_ones_are_copied(bf16_paths):
    hybrid = ModelRunner(bf16_paths["llama_tied"], device="cpu", num_blocks=8, weights="hybrid")
    buffer = hybrid.fused_decode.arena.buffer
    lo, hi = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    moved = [getattr(layer, name).weight16 for layer in hybrid.model.layers for name in MATRICES]
    assert all(lo <= w.data_ptr() < hi for w in moved) and hybrid.fused_decode.bytes_added == 0
    packed = ModelRunner(bf16_paths["llama_tied"], device="cpu", num_blocks=8, weights="fp16")
    assert packed.fused_decode.bytes_added == sum(2 * r * c for layer in packed.model.layers
                                                  for r, c in (getattr(layer, n).shape for n in MATRICES))


def test_the_arena_refuses_more_than_it_was_sized_for():
    arena = HugePageArena(aligned(3 * 4) + aligned(5 * 4))
    a, b = torch.arange(3.0), torch.arange(5.0)
    assert torch.equal(arena.put(a), a) and torch.equal(arena.put(b), b)
    with pytest.raises(ValueError, match="arena full"):
        arena.put(torch.ones(1))


_OTHER_CLASS = """
import json, sys, torch
from agentserve.executor.fused.step import instruction_set
from agentserve.executor.runner import DecodeItem, ModelRunner, PrefillChunk

def logits(path, step, weights, kv, threads):
    runner = ModelRunner(path, device="cpu", dtype="float32", num_blocks=12, block_size=4, weights=weights,
                         kv_cache_dtype=kv, decode_step=step)
    prompts, tables = [[5, 9, 14, 3, 77, 21], [8, 8, 40], [60, 2]], [[0, 1, 2], [3, 4], [5, 6]]
    last = runner.prefill([PrefillChunk(p, 0, t) for p, t in zip(prompts, tables)])
    lens, out = [len(p) for p in prompts], []
    torch.set_num_threads(threads)
    for _ in range(5):
        last = runner.decode([DecodeItem(int(x), n, t) for x, n, t in zip(last.argmax(-1), lens, tables)])
        lens = [n + 1 for n in lens]
        out.append(last)
    torch.set_num_threads(1)
    return torch.stack(out).tolist(), instruction_set(runner.attention.decode_kernel)

runs = []
for path in sys.argv[1:]:
    for weights, kv in (("fp16", "float16"), ("hybrid", "float32")):
        ref, _ = logits(path, "torch", weights, kv, 1)
        for threads in (1, 2):
            got, isa = logits(path, "fused", weights, kv, threads)
            runs.append({"case": [path, weights, kv, threads], "isa": isa, "fused": got, "torch": ref})
print(json.dumps(runs))
"""


def test_the_avx2_products_match_the_pytorch_step_on_either_cpu_class(bf16_paths, odd_path, tmp_path):
    """CI machines are AVX2-only or AVX-512 EPYCs, and each compiles only its own branch of the products: here the
    AVX2 one is built (``-mno-avx512f`` in ``AGENTSERVE_KERNEL_CFLAGS``, a fresh cache, a fresh process) and checked
    on whichever class this is — fp16 and bf16 matrices (the branch each CPU class's ``auto`` reads), fp16 and fp32
    caches, an odd batch, one and two threads, and sizes that take every tail loop — with the native build
    checked by the tests above."""
    env = {**os.environ, build.DIR_ENV: str(tmp_path), build.CFLAGS_ENV: "-mno-avx512f"}
    done = subprocess.run([sys.executable, "-c", _OTHER_CLASS, str(bf16_paths["qwen2_tied_bias"]), str(odd_path)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    runs = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(runs) == 8
    for run in runs:
        assert run["isa"] == "AVX2", run["case"]
        fused, ref = torch.tensor(run["fused"]), torch.tensor(run["torch"])
        assert rel_err(fused, ref) < REL_TOL and torch.equal(fused.argmax(-1), ref.argmax(-1)), run["case"]
        assert rel_err(fused, ref) > 0, run["case"]
    assert list(tmp_path.glob("*/paged_decode.so")), "the AVX2 build went into the fresh cache"
