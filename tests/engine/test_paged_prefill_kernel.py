"""The compiled prefill-attention kernels.  ``bf16`` (AVX512-BF16 CPUs): equal, within the rounding of bf16
weights, to attention in float64 over the same bf16-rounded queries, keys and values; ``fp32`` (AVX2 + FMA +
F16C): equal to attention in float64 on the same inputs within fp32 rounding, and token-exact against
transformers.  Both on random shapes, chunks and scattered block tables; a row's result independent of the chunk
it is in and of the thread count; ``auto`` takes bf16 only where prefill rows already run in bf16, fp32 only on
builds without AVX-512; a clear error for bad input and for a setting that cannot run.  Where a CPU lacks a kernel
its tests skip; the other builds are checked on either class by building the library with ``-mno-avx512bf16``,
``-mno-avx512f`` and ``-mno-avx2`` in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from engine_helpers import (
    BF16_TOL,
    MAX_NEW,
    REL_TOL,
    cpu_has,
    greedy_generate,
    hf_logits,
    random_prompts,
    rel_err,
    whole_and_resumed,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from agentserve.executor import attention
from agentserve.executor.attention import AttentionBatch, cpu_prefill, cpu_prefill_kernel, create_backend
from agentserve.executor.attention.torch_backend import TorchAttention
from agentserve.executor.errors import EngineError
from agentserve.executor.kernels import build
from agentserve.executor.runner import ModelRunner, PrefillChunk

CPU = torch.device("cpu")
F32 = torch.float32
WEIGHTS_TOL = 4e-3  # vs float64 on the same bf16-rounded inputs: the softmax weights' own rounding to bf16
FP32_TOL = 2e-6  # the fp32 kernel vs float64 on the same inputs: fp32 rounding of the sums


def loaded(variant: str, lacking: str) -> cpu_prefill.PagedPrefillKernel:
    """The ``variant`` kernel, or a skip: this CPU lacks ``lacking`` (or there is no C compiler)."""
    built = cpu_prefill.load(variant)
    if built is None:
        pytest.skip(f"no {lacking} here (or no C compiler): no {variant} prefill kernel")
    return built


@pytest.fixture(scope="module")
def kernel() -> cpu_prefill.PagedPrefillKernel:
    return loaded("bf16", "AVX512-BF16")


@pytest.fixture(scope="module")
def fp32_kernel() -> cpu_prefill.PagedPrefillKernel:
    return loaded("fp32", "AVX2 + FMA + F16C")


@pytest.fixture(scope="module", params=["bf16", "fp32"])
def any_kernel(request) -> cpu_prefill.PagedPrefillKernel:
    return request.getfixturevalue("kernel" if request.param == "bf16" else "fp32_kernel")


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, start: int,
              scale: float, rounded=bf16) -> torch.Tensor:
    """Causal attention of q [n, heads, dim] in float64 over the gathered keys, every input passed through
    ``rounded`` (bf16 rounding, or none: ``torch.Tensor.double``)."""
    n, heads, dim = q.shape
    group = heads // k_cache.shape[2]
    keys = rounded(k_cache[table].flatten(0, 1)[: start + n])
    vals = rounded(v_cache[table].flatten(0, 1)[: start + n])
    out = torch.empty(n, heads, dim, dtype=torch.float64)
    for i in range(n):
        for h in range(heads):
            s = keys[: start + i + 1, h // group] @ rounded(q[i, h]) * scale
            out[i, h] = torch.softmax(s, 0) @ vals[: start + i + 1, h // group]
    return out


def random_case(kv_heads: int, group: int, dim: int, block_size: int, tokens: int, dtype: torch.dtype, seed: int,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Caches with spare blocks and a random, scattered table of the blocks ``tokens`` need (plus two unused)."""
    g = torch.Generator().manual_seed(seed)
    need = -(-tokens // block_size)
    num_blocks = need + 5
    k_cache, v_cache = (torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
    table = torch.randperm(num_blocks, generator=g)[: need + 2].contiguous()
    return k_cache, v_cache, table


@settings(max_examples=60, deadline=None)
@given(kv_heads=st.integers(1, 3), group=st.sampled_from([1, 2, 4, 5]),
       dim=st.sampled_from([16, 32, 48, 64, 80, 96, 112, 128]), block_size=st.sampled_from([1, 5, 16, 64]),
       start=st.integers(0, 90), n=st.integers(1, 70),
       threads=st.integers(1, 3), f16=st.booleans(), seed=st.integers(0, 2**16))
def test_the_kernel_matches_float64_attention_on_its_bf16_inputs(kernel, kv_heads, group, dim, block_size, start, n,
                                                                threads, f16, seed):
    k_cache, v_cache, table = random_case(kv_heads, group, dim, block_size, start + n,
                                          torch.float16 if f16 else F32, seed)
    q = torch.randn(n, kv_heads * group, dim, generator=torch.Generator().manual_seed(seed + 1))
    scale = dim**-0.5
    got = kernel(q, k_cache, v_cache, table, start, scale, threads)
    want = reference(q, k_cache, v_cache, table, start, scale)
    assert ((got.double() - want).norm() / want.norm()).item() < WEIGHTS_TOL


@pytest.mark.parametrize("dim", [64, 80, 128])  # the walks specialised for 64 and 128, and the general one
@pytest.mark.parametrize("climb", [0.2, -0.2])
def test_scores_that_climb_or_fall_along_the_keys_by_hundreds(kernel, dim, climb):
    """Every key leans along one direction by ``climb`` * its position, and so do the queries: a row's scores drift
    by hundreds across its keys (up: the walk's running maximum moves many times, far past the margin it lets the
    weights grow by; down: the first keys dominate and later weights vanish): the kernel still matches float64
    attention."""
    k_cache, v_cache, table = random_case(2, 4, dim, 16, 300, F32, 11)
    g = torch.Generator().manual_seed(12)
    u = torch.nn.functional.normalize(torch.randn(dim, generator=g), dim=0)
    slots = (table[:, None] * 16 + torch.arange(16)).flatten()[:300]  # token t's slot in the flattened cache
    k_cache.view(-1, 2, dim)[slots] += (climb * torch.arange(300.0))[:, None, None] * u * dim**0.5
    q = torch.randn(60, 8, dim, generator=g) + 2 * u
    got = kernel(q, k_cache, v_cache, table, 240, dim**-0.5, 2)
    want = reference(q, k_cache, v_cache, table, 240, dim**-0.5)
    assert ((got.double() - want).norm() / want.norm()).item() < WEIGHTS_TOL


@settings(max_examples=60, deadline=None)
@given(kv_heads=st.integers(1, 3), group=st.sampled_from([1, 2, 3, 4, 5]),
       dim=st.sampled_from([8, 16, 24, 40, 64, 72, 96, 128]), block_size=st.sampled_from([1, 5, 16, 64]),
       start=st.integers(0, 1200), n=st.integers(1, 70),
       threads=st.integers(1, 3), f16=st.booleans(), seed=st.integers(0, 2**16))
def test_the_fp32_kernel_matches_float64_attention(fp32_kernel, kv_heads, group, dim, block_size, start, n, threads,
                                                   f16, seed):
    """Starts up to 1200 keys: prompts cross the kernel's chunks of 512 keys and its blocks of 64."""
    k_cache, v_cache, table = random_case(kv_heads, group, dim, block_size, start + n,
                                          torch.float16 if f16 else F32, seed)
    q = torch.randn(n, kv_heads * group, dim, generator=torch.Generator().manual_seed(seed + 1))
    scale = dim**-0.5
    got = fp32_kernel(q, k_cache, v_cache, table, start, scale, threads)
    want = reference(q, k_cache, v_cache, table, start, scale, rounded=torch.Tensor.double)
    assert ((got.double() - want).norm() / want.norm()).item() < FP32_TOL


@pytest.mark.parametrize("dim", [64, 96])  # the walk specialised for 64, and the general one
def test_a_row_does_not_depend_on_its_chunk_or_the_threads(any_kernel, dim):
    """Token 650 of a sequence attended as row 10 of a 40-token chunk from position 640, as row 650 of one chunk
    from 0, on 1 or 3 threads: bitwise the same (a sequence's numbers never depend on how it was split)."""
    k_cache, v_cache, table = random_case(2, 4, dim, 16, 680, torch.float16, 3)
    q = torch.randn(680, 8, dim, generator=torch.Generator().manual_seed(4))
    whole = any_kernel(q, k_cache, v_cache, table, 0, 0.125, 1)
    part = any_kernel(q[640:].contiguous(), k_cache, v_cache, table, 640, 0.125, 3)
    assert torch.equal(whole[640:], part)
    assert torch.equal(whole, any_kernel(q, k_cache, v_cache, table, 0, 0.125, 2))


def test_the_kernel_keeps_its_working_memory_between_calls(any_kernel):
    """A resume at an agent's context (64 tokens after 3,000; 1.5 MB of packed keys and values a layer on the bf16
    kernel) called again on the same thread faults in next to no new pages: the working memory is the thread's, not
    mapped afresh by each call (which cost a fifth of a resume step in a server)."""
    import resource
    import threading

    k_cache, v_cache, table = random_case(2, 4, 64, 16, 3064, torch.float16, 6)
    q = torch.randn(64, 8, 64, generator=torch.Generator().manual_seed(7))
    faults: list[int] = []

    def calls() -> None:
        for _ in range(6):
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            any_kernel.run(q, k_cache, v_cache, table, 3000, 0.125, 1)
            faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)

    t = threading.Thread(target=calls)  # a thread of its own, as a lane's
    t.start()
    t.join()
    assert len(faults) == 6 and max(faults[2:]) < 40, faults  # the output (32 KiB) at most, not ~400 pages a call


def test_bad_input_is_refused_with_a_clear_error(any_kernel):
    kernel = any_kernel
    k_cache, v_cache, table = random_case(2, 2, 32, 4, 20, F32, 5)
    q = torch.randn(6, 4, 32)
    with pytest.raises(ValueError, match="beyond 7 blocks"):  # 30 + 6 tokens need 9 blocks, the table has 7
        kernel(q, k_cache, v_cache, table, 30, 0.2)
    bad = table.clone()
    bad[0] = k_cache.shape[0]
    with pytest.raises(ValueError, match="^paged prefill kernel: a block id outside"):
        kernel(q, k_cache, v_cache, bad, 0, 0.2)
    with pytest.raises(ValueError, match="contiguous"):
        kernel(q.transpose(0, 1).contiguous().transpose(0, 1), k_cache, v_cache, table, 0, 0.2)
    with pytest.raises(ValueError, match="mismatched"):
        kernel(q[:, :, :16], k_cache, v_cache, table, 0, 0.2)
    step = 16 if kernel.variant == "bf16" else 8  # head sizes a multiple of this
    assert not kernel.supports(4, 2, step + step // 2, 4) and kernel.supports(4, 2, 2 * step, 4)
    assert not kernel.supports(4, 2, 32, 128) and not kernel.supports(4, 2, 136, 4)
    assert not kernel.supports(4, 2, 0, 4) and not kernel.supports(4, 2, -16, 4) and not kernel.supports(6, 4, 32, 4)
    odd = torch.randn(8, 4, 2, step + step // 2)
    with pytest.raises(ValueError, match="does not take"):
        kernel.run(torch.randn(3, 4, step + step // 2), odd, odd, table, 0, 0.2, 1)


def test_a_mixed_step_sends_only_its_longer_chunks_to_the_kernel(any_kernel):
    """One step: a 29-token chunk after 37 cached tokens (its table longer than it needs), a decode riding beside
    it, a one-token new prompt and an 18-token new prompt.  Against the PyTorch backend on the same inputs: the
    decode row and the one-token prompt are bitwise the same (they never reach the kernel), the two longer chunks
    within the kernel's rounding (bf16's, or fp32's) and not equal (they were attended in another order)."""
    kernel = any_kernel
    heads, kv_heads, dim, bs = 4, 2, 32, 8
    g = torch.Generator().manual_seed(8)
    lens, starts = [29, 1, 1, 18], [37, 20, 0, 0]
    tables = [list(range(0, 10)), list(range(10, 13)), [13], [14, 15, 16]]
    slots = torch.tensor([t[p // bs] * bs + p % bs for t, s, n in zip(tables, starts, lens, strict=True)
                          for p in range(s, s + n)])
    batch = AttentionBatch(False, lens, starts, tables, slots)
    total = sum(lens)
    q, k, v = (torch.randn(total, h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    cache = [torch.randn(20, bs, kv_heads, dim, generator=g).half() for _ in range(2)]
    outs = []
    for backend in (TorchAttention(heads, kv_heads, dim, bs, CPU, prefill_kernel=kernel),
                    TorchAttention(heads, kv_heads, dim, bs, CPU)):
        k_cache, v_cache = (c.clone() for c in cache)
        outs.append(backend.forward(q, k, v, k_cache, v_cache, backend.plan(batch)).view(total, heads, dim))
    got, want = outs
    assert torch.equal(got[29:31], want[29:31])  # the riding decode and the one-token prompt
    for rows in (slice(0, 29), slice(31, 49)):  # fp32 against every input rounded to bf16, or fp32 sums reordered
        assert 0 < rel_err(got[rows], want[rows]) < (2e-2 if kernel.variant == "bf16" else 1e-5)


class _Counting:
    """A kernel that records the thread count of each call (and runs the real one)."""

    def __init__(self, inner) -> None:
        self.inner, self.threads = inner, []

    def run(self, *args):
        self.threads.append(args[-1])
        return self.inner.run(*args)


def test_the_kernel_runs_on_the_threads_of_the_moment_not_of_the_plan(any_kernel):
    """A prefill step plans once, then the core loan narrows its lane between two layers (decode wants its core):
    the layers after that must attend on one thread.  A count taken at planning started a second thread there,
    which the kernel's region created beside the lane thread on its one remaining core."""
    heads, kv_heads, dim, bs = 4, 2, 32, 8
    g = torch.Generator().manual_seed(3)
    lens, starts, tables = [24], [16], [list(range(6))]
    slots = torch.tensor([tables[0][p // bs] * bs + p % bs for p in range(16, 40)])
    q, k, v = (torch.randn(24, h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    cache = [torch.randn(8, bs, kv_heads, dim, generator=g).half() for _ in range(2)]
    counting = _Counting(any_kernel)
    backend = TorchAttention(heads, kv_heads, dim, bs, CPU, prefill_kernel=counting)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        meta = backend.plan(AttentionBatch(False, lens, starts, tables, slots))
        torch.set_num_threads(1)  # narrowed between layers
        backend.forward(q, k, v, *cache, meta)
        torch.set_num_threads(2)  # widened again
        backend.forward(q, k, v, *cache, meta)
    finally:
        torch.set_num_threads(before)
    assert counting.threads == [1, 2]


def prefill_kernel(setting: str, bf16_rows: bool, backend: str = "auto"):
    return create_backend(backend, 4, 2, 32, 16, CPU, F32, torch.float16, setting, bf16_rows).prefill_kernel


def test_auto_attends_in_bf16_only_where_prefill_rows_already_are(kernel, monkeypatch):
    """Without AMX tiles (with them ``auto`` attends through PyTorch's bf16 path instead: its own test)."""
    monkeypatch.setattr(attention, "cpu_has_amx", lambda: False)
    assert prefill_kernel("auto", bf16_rows=True) is kernel
    assert prefill_kernel("auto", bf16_rows=False) is not kernel  # fp32 (or packed fp16) prefill products stay fp32
    assert prefill_kernel("bf16", bf16_rows=False) is kernel  # reachable by its flag on any matrices
    assert prefill_kernel("torch", bf16_rows=True) is None


def test_auto_takes_the_fp32_kernel_only_on_builds_without_avx512(fp32_kernel):
    """This machine's build, either class (the other class's build: the subprocess tests below)."""
    preferred = cpu_prefill.preferred()
    assert preferred == (not cpu_has("avx512f"))
    assert prefill_kernel("auto", bf16_rows=False) is (fp32_kernel if preferred else None)
    assert prefill_kernel("fp32", bf16_rows=True) is fp32_kernel  # reachable by its flag on any matrices
    assert prefill_kernel("torch", bf16_rows=False) is None


def test_auto_builds_nothing_where_no_prefill_kernel_can_run(monkeypatch):
    """Backend ``torch``, a CUDA device, a bf16 model: ``auto`` answers PyTorch without building the CPU library."""
    built = []
    monkeypatch.setattr(build, "library", lambda: built.append(1))
    cuda = torch.device("cuda")
    for name, device, dtype in (("torch", CPU, F32), ("auto", cuda, F32), ("auto", CPU, torch.bfloat16)):
        kernel, why = cpu_prefill_kernel("auto", name, 4, 2, 32, 16, device, dtype, bf16_rows=False)
        assert kernel is None and why
    assert not built


@pytest.mark.parametrize("setting", ["bf16", "fp32"])
def test_settings_that_cannot_run_fail_clearly(setting):
    with pytest.raises(EngineError, match="unknown prefill_attention"):
        prefill_kernel("fast", bf16_rows=True)
    with pytest.raises(EngineError, match=f"prefill_attention '{setting}' is unavailable: attention backend 'torch'"):
        prefill_kernel(setting, bf16_rows=True, backend="torch")
    with pytest.raises(EngineError, match=f"prefill_attention '{setting}' is unavailable: it needs a float32 model"):
        create_backend("auto", 4, 2, 32, 16, CPU, torch.bfloat16, None, setting, True)


@pytest.mark.parametrize("chunk_size", [None, 7, 64])
def test_an_fp32_runner_through_the_kernel_is_token_exact_against_transformers(fp32_kernel, case, chunk_size):
    """``prefill_attention = fp32`` on every architecture: greedy tokens equal transformers' (whole prompts and
    chunked), and logits within the fp32 tolerance."""
    runner = ModelRunner(case.path, dtype="float32", device="cpu", num_blocks=96, block_size=8,
                         prefill_attention="fp32")
    assert runner.prefill_kernel is fp32_kernel
    tokens = case.prompts[-1]
    logits = runner.prefill([PrefillChunk(tokens, 0, list(range(10)))], all_logits=True)[0]
    assert rel_err(logits, hf_logits(case.hf, tokens)) < REL_TOL
    assert greedy_generate(runner, case.prompts, MAX_NEW, chunk_size) == case.expected


def test_a_hybrid_runner_prefills_through_the_kernel_within_bf16_tolerance(kernel, bf16_checkpoints, monkeypatch):
    """``auto`` on a hybrid model: chunks of more than one token attend through the kernel; logits of a whole
    prompt and of the same prompt resumed in two chunks stay within the bf16 tolerance of transformers, and
    differ from PyTorch's fp32 attention by no more than bf16 rounding."""
    path, hf = bf16_checkpoints["qwen3_headdim"]  # head size 32
    monkeypatch.setattr(attention, "cpu_has_amx", lambda: False)  # with AMX tiles auto attends through PyTorch
    runs = {}
    for setting in ("auto", "torch"):
        runner = ModelRunner(path, dtype="float32", device="cpu", num_blocks=64, block_size=8, weights="hybrid",
                             prefill_attention=setting)
        assert (runner.prefill_kernel is kernel) == (setting == "auto")
        tokens = random_prompts([70], seed=21)[0]
        whole, resumed = whole_and_resumed(runner, tokens, 45)
        assert rel_err(whole, hf_logits(hf, tokens)) < BF16_TOL
        assert rel_err(resumed, whole[45:]) < BF16_TOL
        runs[setting] = whole
    assert 0 < rel_err(runs["auto"], runs["torch"]) < BF16_TOL  # the kernel ran (it rounds), and within bf16


FALLBACK = r"""
import json, sys
from agentserve.executor import attention
from agentserve.executor.attention import cpu_prefill
from agentserve.executor.errors import EngineError
from agentserve.executor.kernels import build
from agentserve.executor.runner import ModelRunner

out = {"library": build.library() is not None, "bf16": cpu_prefill.load("bf16") is not None,
       "fp32": cpu_prefill.load("fp32") is not None}
attention.cpu_has_amx = lambda: False  # the CPUs these builds stand for have no AMX tiles either
runner = ModelRunner(sys.argv[1], dtype="float32", device="cpu", num_blocks=8, weights="hybrid")
out["auto"] = runner.prefill_kernel and runner.prefill_kernel.variant
for setting in ("bf16", "fp32"):
    try:
        ModelRunner(sys.argv[1], dtype="float32", device="cpu", num_blocks=8, weights="hybrid",
                    prefill_attention=setting)
    except EngineError as e:
        out[setting + "_error"] = str(e)
print(json.dumps(out))
"""


def other_build(flags: str, path, tmp_path) -> dict:
    """What a library built with the extra compile ``flags`` offers (fresh cache, fresh process)."""
    if build.compiler() is None:
        pytest.skip("no C compiler on this machine")
    env = {**os.environ, build.DIR_ENV: str(tmp_path), build.CFLAGS_ENV: flags}
    done = subprocess.run([sys.executable, "-c", FALLBACK, str(path)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not build.compiler(), reason="no C compiler")
@pytest.mark.parametrize("flags", ["-mno-avx512bf16", "-mno-avx512f"])
def test_without_avx512_bf16_auto_takes_fp32_where_avx512_is_absent_and_bf16_fails_clearly(bf16_checkpoints,
                                                                                          tmp_path, flags):
    """The CPUs without AVX512-BF16, checked on either class: without AVX-512 at all (AVX2-only EPYCs) ``auto`` takes
    the fp32 kernel; with AVX-512 but no bf16 it keeps PyTorch; ``bf16`` says why it cannot run."""
    if not cpu_has("avx2"):
        pytest.skip("no AVX2 here: no fp32 prefill kernel in any build")
    path, _ = bf16_checkpoints["qwen3_headdim"]
    out = other_build(flags, path, tmp_path)
    assert out["library"] and not out["bf16"] and out["fp32"] and "fp32_error" not in out
    assert "no AVX512-BF16" in out["bf16_error"]
    assert out["auto"] == (None if flags == "-mno-avx512bf16" and cpu_has("avx512f") else "fp32")


def test_without_avx2_both_kernels_are_absent_and_auto_keeps_pytorch(bf16_checkpoints, tmp_path):
    path, _ = bf16_checkpoints["qwen3_headdim"]
    out = other_build("-mno-avx2", path, tmp_path)
    assert out["library"] and not out["bf16"] and not out["fp32"] and out["auto"] is None
    assert "no AVX2 + FMA + F16C" in out["fp32_error"]
