"""The compiled CPU paged-decode kernel: equal to attention computed in float64 on random shapes and scattered
block tables, chosen by the ``auto`` backend where it builds, matching transformers inside the runner, and
a clean fallback (or a clear error for ``cpu-kernel``) where it cannot be used."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from engine_helpers import REL_TOL, cpu_has, hf_logits, random_prompts, rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

from agentserve.executor.attention import cpu_kernel, create_backend
from agentserve.executor.errors import EngineError
from agentserve.executor.kernels import build
from agentserve.executor.runner import DecodeItem, ModelRunner, PrefillChunk

pytestmark = pytest.mark.skipif(build.compiler() is None, reason="no C compiler on this machine")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernel() -> cpu_kernel.PagedDecodeKernel:
    built = cpu_kernel.load()
    assert built is not None, "a C compiler is present, so the kernel must build"
    return built


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
              lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain attention per sequence and head in float64 over the gathered first ``lens[b]`` tokens."""
    b, heads, dim = q.shape
    group = heads // k_cache.shape[2]
    out = torch.empty(b, heads, dim, dtype=torch.float64)
    for i, n in enumerate(lens.tolist()):
        keys = k_cache[tables[i]].flatten(0, 1)[:n].double()  # [n, kv_heads, dim]
        vals = v_cache[tables[i]].flatten(0, 1)[:n].double()
        for h in range(heads):
            s = keys[:, h // group] @ q[i, h].double() * scale
            out[i, h] = torch.softmax(s, 0) @ vals[:, h // group]
    return out


def random_case(kv_heads: int, group: int, dim: int, block_size: int, lens: list[int], magnitude: float,
                seed: int, shared: int = 0) -> tuple[torch.Tensor, ...]:
    """Caches with more blocks than needed; each sequence's blocks are a random, scattered selection, the
    first ``shared`` of them the same blocks in every sequence (a cached common prefix)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 3
    k_cache, v_cache = (torch.randn(num_blocks, block_size, kv_heads, dim, generator=g) for _ in range(2))
    order = torch.randperm(num_blocks, generator=g).tolist()
    width = max(need) + 2  # padding past each row's blocks must be ignored
    tables = torch.zeros(len(lens), width, dtype=torch.int64)
    at = shared
    for i, n in enumerate(need):
        own = max(0, n - shared)
        tables[i, :n] = torch.tensor(order[: min(n, shared)] + order[at : at + own])
        tables[i, n:] = order[-1]
        at += own
    q = torch.randn(len(lens), kv_heads * group, dim, generator=g) * magnitude
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int64)


@settings(max_examples=60, deadline=None)
@given(kv_heads=st.sampled_from([1, 2, 4]), group=st.sampled_from([1, 2, 3, 4, 5, 8, 16]),
       dim=st.sampled_from([8, 12, 48, 64, 80, 128]), block_size=st.sampled_from([1, 4, 7, 16, 64]),
       lens=st.lists(st.integers(1, 200), min_size=1, max_size=5), magnitude=st.sampled_from([1.0, 30.0]),
       seed=st.integers(0, 2**16), shared=st.integers(0, 12))
def test_kernel_equals_float64_attention(kernel, kv_heads, group, dim, block_size, lens, magnitude, seed, shared):
    """Groups of odd sizes, head sizes with and without a vector remainder, partial last blocks, large
    scores (the online softmax must rescale without overflow), and leading blocks shared by the batch
    (read once per lockstep step for all its sequences, also where some sequence ends inside them)."""
    q, k_cache, v_cache, tables, lens_t = random_case(kv_heads, group, dim, block_size, lens, magnitude, seed,
                                                      shared)
    scale = dim**-0.5
    got = kernel(q, k_cache, v_cache, tables, lens_t, scale)
    want = reference(q, k_cache, v_cache, tables, lens_t, scale)
    assert torch.allclose(got.double(), want, atol=2e-5 * magnitude, rtol=1e-4)


def test_the_walk_is_as_wide_as_the_cpu_allows(kernel):
    want = 16 if cpu_has("avx512f") else 8 if cpu_has("avx2") and cpu_has("fma") else 1
    assert kernel.lanes == want


OTHER_WALK = r"""
import json
from test_paged_decode_kernel import random_case, reference
from agentserve.executor.attention import cpu_kernel

kernel, worst = cpu_kernel.load(), 0.0
for seed, (kv_heads, group, dim) in enumerate([(2, 4, 64), (1, 3, 80), (2, 8, 128), (1, 16, 64), (2, 5, 48)]):
    for half in (False, True):
        q, k, v, tables, lens = random_case(kv_heads, group, dim, 16, [300, 41, 170], 30.0, seed, shared=3)
        k, v = (k.half(), v.half()) if half else (k, v)
        got = kernel(q, k, v, tables, lens, dim**-0.5).double()
        want = reference(q, k.float(), v.float(), tables, lens, dim**-0.5)
        worst = max(worst, ((got - want).abs() / (2e-5 * 30.0 + 1e-4 * want.abs())).max().item())
print(json.dumps({"lanes": kernel.lanes, "worst": worst}))
"""


def test_the_avx2_walk_equals_float64_attention_on_either_cpu_class(tmp_path):
    """Each CPU class compiles only its own walk: here the AVX2 one is built (``-DAGENTSERVE_DECODE_AVX2``, a fresh
    cache, a fresh process; on an AVX2-only CPU the same as the native build) and checked on whichever class this is,
    with the native walk checked by the tests above."""
    if not (cpu_has("avx2") and cpu_has("fma") and cpu_has("f16c")):
        pytest.skip("no AVX2 + FMA + F16C here")
    env = {**os.environ, build.DIR_ENV: str(tmp_path), build.CFLAGS_ENV: "-DAGENTSERVE_DECODE_AVX2",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", OTHER_WALK], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["lanes"] == 8 and out["worst"] <= 1.0, out


def test_threads_split_sequences_without_changing_results(kernel):
    q, k_cache, v_cache, tables, lens = random_case(2, 4, 64, 16, [300, 170, 100, 129, 64, 250], 1.0, seed=3,
                                                    shared=3)
    one = kernel(q, k_cache, v_cache, tables, lens, 0.125, threads=1)
    for threads in (2, 4, 6, 8):  # fewer groups than sequences, one each, more threads than sequences
        assert torch.equal(kernel(q, k_cache, v_cache, tables, lens, 0.125, threads=threads), one)


@pytest.mark.parametrize("kv_heads, group, dim, block_size", [(2, 4, 64, 16), (1, 1, 12, 1), (3, 3, 64, 7),
                                                              (2, 5, 128, 16)])
def test_a_sequence_gets_the_same_bits_alone_as_in_a_batch_sharing_its_prefix(kernel, kv_heads, group, dim,
                                                                               block_size):
    """The batch is walked in lockstep, but each sequence still sees its blocks in its own order."""
    q, k_cache, v_cache, tables, lens = random_case(kv_heads, group, dim, block_size, [300, 170, 100, 129, 64, 250],
                                                    1.0, seed=5, shared=4)
    batch = kernel(q, k_cache, v_cache, tables, lens, 0.125)
    for i in range(len(lens)):
        alone = kernel(q[i : i + 1], k_cache, v_cache, tables[i : i + 1], lens[i : i + 1], 0.125)
        assert torch.equal(alone[0], batch[i])


def test_an_empty_batch_gives_an_empty_result(kernel):
    q, k_cache, v_cache, tables, lens = random_case(2, 2, 8, 4, [5], 1.0, seed=0)
    assert kernel(q[:0], k_cache, v_cache, tables[:0], lens[:0], 0.3).shape == (0, 4, 8)


def test_kernel_refuses_what_it_cannot_take(kernel):
    assert kernel.supports(8, 2, 64, 16) and kernel.supports(32, 8, 128, 32)
    assert not kernel.supports(8, 3, 64, 16)  # heads not a multiple of KV heads
    assert not kernel.supports(8, 2, 64, 128)  # block larger than its buffers
    q, k_cache, v_cache, tables, lens = random_case(2, 2, 8, 4, [5], 1.0, seed=0)
    with pytest.raises(ValueError, match="contiguous CPU"):
        kernel(q.double(), k_cache, v_cache, tables, lens, 0.3)
    with pytest.raises(ValueError, match="does not take"):
        big = torch.zeros(2, 128, 2, 8)  # blocks of 128 tokens
        kernel(q, big, big, torch.zeros(1, 1, dtype=torch.int64), lens, 0.3)


def test_kernel_refuses_lengths_and_block_ids_outside_the_cache(kernel):
    q, k_cache, v_cache, tables, lens = random_case(2, 2, 8, 4, [5, 9], 1.0, seed=0)  # tables are 4 wide
    for bad_tables, bad_lens in ((tables, torch.tensor([5, 0])), (tables, torch.tensor([5, 21])),
                                 (tables.clone().fill_(len(k_cache)), lens), (tables.clone().fill_(-1), lens)):
        with pytest.raises(ValueError, match="outside"):
            kernel(q, k_cache, v_cache, bad_tables, bad_lens, 0.3)
    for bad in (tables[:1], tables[:, 0].contiguous()):  # a row short; one dimension
        with pytest.raises(ValueError, match="mismatched shapes"):
            kernel(q, k_cache, v_cache, bad, lens, 0.3)


def test_auto_backend_uses_the_kernel_only_for_float32_on_the_cpu(kernel):
    assert create_backend("auto", 8, 2, 64, 16, CPU, torch.float32).decode_kernel is not None
    assert create_backend("torch", 8, 2, 64, 16, CPU, torch.float32).decode_kernel is None
    assert create_backend("auto", 8, 2, 64, 16, CPU, torch.bfloat16).decode_kernel is None
    assert create_backend("auto", 8, 2, 64, 128, CPU, torch.float32).decode_kernel is None
    with pytest.raises(EngineError, match="float32 model on the CPU"):
        create_backend("cpu-kernel", 8, 2, 64, 16, CPU, torch.bfloat16)
    with pytest.raises(EngineError, match="in blocks of 128"):
        create_backend("cpu-kernel", 8, 2, 64, 128, CPU, torch.float32)
    with pytest.raises(EngineError, match="available: auto, torch, cpu-kernel"):
        create_backend("flash", 8, 2, 64, 16, CPU, torch.float32)


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """An empty kernel cache and no remembered load, restored afterwards."""
    monkeypatch.setenv(build.DIR_ENV, str(tmp_path))
    build.forget()
    yield tmp_path
    build.forget()


def test_builds_once_into_its_cache(fresh_build):
    assert cpu_kernel.load() is not None
    [built] = list(fresh_build.glob("*/paged_decode.so"))
    stamp = built.stat().st_mtime_ns
    build.forget()
    assert cpu_kernel.load() is not None and built.stat().st_mtime_ns == stamp
    assert [p.name for p in built.parent.iterdir()] == ["paged_decode.so"]  # no temporary left behind


def test_without_a_working_compiler_auto_falls_back_and_cpu_kernel_says_why(fresh_build, monkeypatch, caplog):
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    monkeypatch.setattr(build.shutil, "which", lambda name: "/bin/false" if name == "false" else None)
    assert cpu_kernel.load() is None
    assert "PyTorch path" in caplog.text and list(fresh_build.rglob("*.so")) == []
    assert create_backend("auto", 8, 2, 64, 16, CPU, torch.float32).decode_kernel is None
    with pytest.raises(EngineError, match="could not be built"):
        create_backend("cpu-kernel", 8, 2, 64, 16, CPU, torch.float32)
    build.forget()
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    assert cpu_kernel.load() is None and "no C compiler" in caplog.text


def test_bad_extra_compiler_flags_fall_back_like_a_failed_build(fresh_build, monkeypatch, caplog):
    monkeypatch.setenv(build.CFLAGS_ENV, '-O2 "unbalanced')  # shlex cannot split it
    assert cpu_kernel.load() is None and "unavailable" in caplog.text
    build.forget()
    monkeypatch.setenv(build.CFLAGS_ENV, "-fno-such-flag-anywhere")  # the compiler refuses it
    assert cpu_kernel.load() is None and list(fresh_build.rglob("*.so")) == []


def test_runner_with_the_kernel_matches_transformers(case, kernel):
    """Sequences of different lengths in scattered blocks, decoded as one batch through the kernel."""
    runner = ModelRunner(case.path, dtype="float32", device="cpu", num_blocks=48, block_size=8,
                         attention_backend="cpu-kernel")
    assert runner.attention.decode_kernel is not None
    prompts = random_prompts([5, 40, 77], seed=11)
    tables = [[40, 3], [7, 30, 1, 22, 12, 9], [2, 44, 18, 27, 5, 33, 11, 39, 20, 14, 35]]
    runner.prefill([PrefillChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    nxt = [17, 3, 250]
    got = runner.decode([DecodeItem(x, len(p), t) for x, p, t in zip(nxt, prompts, tables, strict=True)])
    for row, p, x in zip(got, prompts, nxt, strict=True):
        assert rel_err(row, hf_logits(case.hf, p + [x])[-1]) < REL_TOL


def test_loading_the_kernel_keeps_subnormal_floats(tmp_path):
    """-ffast-math on the link line would make the library flush subnormals to zero process-wide, and the
    kernel sets the flush mode only for its own loop."""
    probe = ("from agentserve.executor.attention import cpu_kernel; import torch; k = cpu_kernel.load(); "
             "c = torch.randn(2, 4, 1, 8); "  # attend once: the kernel's own flush must not outlive the call
             "k(torch.randn(1, 2, 8) * 40, c, c, torch.tensor([[0, 1]]), torch.tensor([7]), 1.0); "
             "tiny = float.fromhex('0x1p-1060'); print(tiny * 1.5 > 0, (torch.tensor([1e-40]) * 1.5).item() > 0)")
    env = {**os.environ, build.DIR_ENV: str(tmp_path)}  # a fresh build, loaded into a fresh process
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["True", "True"], done.stderr
