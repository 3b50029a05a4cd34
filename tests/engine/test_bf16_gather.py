"""The compiled bf16 gather (``gather_bf16.c``): an fp16 cache's blocks as bf16 in one pass, bitwise PyTorch's
``index_select`` and casts through fp32 for every fp16 bit pattern but NaN (a NaN stays a NaN), on any thread count;
block ids outside the cache and short tables refused; the attention backend's prefill through it bitwise the same
as through PyTorch's passes, and ``create_backend`` giving it exactly to bf16 attention over an fp16 cache."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentserve.executor.attention import AttentionBatch, cpu_gather, create_backend
from agentserve.executor.attention.torch_backend import TorchAttention, _cast, _gather
from agentserve.executor.kernels import build

GATHER = cpu_gather.load()
pytestmark = pytest.mark.skipif(GATHER is None, reason="no C compiler with F16C builds the CPU library here")
CPU = torch.device("cpu")


def pytorch_passes(cache: torch.Tensor, blocks: torch.Tensor, n: int) -> torch.Tensor:
    return _cast(_gather(cache, blocks)[:n], torch.bfloat16)


def assert_same_bits_nan_as_nan(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


@settings(max_examples=40, deadline=None)
@given(num_blocks=st.integers(1, 12), block_size=st.sampled_from([1, 3, 16]), heads=st.integers(1, 3),
       dim=st.sampled_from([1, 7, 16, 64]), threads=st.integers(1, 3), data=st.data(), seed=st.integers(0, 2**16))
def test_every_fp16_bit_pattern_gathers_as_pytorch_casts_it(num_blocks, block_size, heads, dim, threads, data, seed):
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**15), 2**15, (num_blocks, block_size, heads, dim), dtype=torch.int16, generator=g)
    cache = bits.view(torch.float16)
    used = data.draw(st.integers(1, num_blocks))
    blocks = torch.randperm(num_blocks, generator=g)[:used].to(torch.int64)
    n = data.draw(st.integers(0, used * block_size))
    assert_same_bits_nan_as_nan(GATHER(cache, blocks, n, threads), pytorch_passes(cache, blocks, n))


def test_rounding_ties_subnormals_and_infinities():
    """The fp16 values whose bf16 rounding is delicate: ties (to even, both ways), fp16 subnormals, the largest
    finite value, infinities and signed zeros."""
    values = [1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-10, -(1 + 2**-8), 2**-24, -(2**-24), 2**-14 - 2**-24,
              65504.0, float("inf"), float("-inf"), 0.0, -0.0, 1 / 3, -2.5]
    values = values + [0.0, 0.0] + values  # one copy in a 16-wide vector, one in the scalar tail
    cache = torch.tensor(values, dtype=torch.float16).view(1, len(values), 1, 1)
    blocks = torch.zeros(1, dtype=torch.int64)
    got = GATHER(cache, blocks, len(values)).view(-1)
    assert torch.equal(got.view(torch.int16), pytorch_passes(cache, blocks, len(values)).view(torch.int16).view(-1))
    for i in (0, 16):
        assert got[i].item() == 1.0 and got[i + 1].item() == 1 + 2**-6  # ties go to the even neighbour


def test_bad_arguments_are_refused():
    cache = torch.zeros(4, 16, 2, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="outside"):
        GATHER(cache, torch.tensor([0, 4]), 20)
    with pytest.raises(ValueError, match="outside"):
        GATHER(cache, torch.tensor([-1]), 3)
    with pytest.raises(ValueError, match="beyond"):
        GATHER(cache, torch.tensor([0, 1]), 33)
    with pytest.raises(ValueError, match="fp16"):
        GATHER(cache.float(), torch.tensor([0]), 3)
    with pytest.raises(ValueError, match="fp16"):  # an empty cache or blocks of no tokens (a division by zero in C)
        GATHER(torch.zeros(4, 0, 2, 8, dtype=torch.float16), torch.tensor([0]), 0)
    with pytest.raises(ValueError, match="contiguous"):
        GATHER(cache, torch.tensor([0, 1, 2, 3])[::2], 3)


@pytest.mark.parametrize("start, n", [(0, 40), (37, 5), (100, 260)])
def test_a_prefill_through_it_is_bitwise_a_prefill_through_pytorchs_passes(start, n):
    heads, kv_heads, dim, bs = 8, 2, 64, 16
    g = torch.Generator().manual_seed(start + n)
    need = -(-(start + n) // bs)
    table = torch.randperm(need + 3, generator=g)[:need].tolist()
    cache = [(torch.randn(need + 3, bs, kv_heads, dim, generator=g) * 2).half() for _ in range(2)]
    q, k, v = (torch.randn(n, h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(start, start + n)])
    batch = AttentionBatch(False, [n], [start], [table], slots)
    outs, calls = [], []

    def counted(*args):
        calls.append(args[2])
        return GATHER(*args)

    for gather in (counted, None):
        backend = TorchAttention(heads, kv_heads, dim, bs, CPU, prefill_dtype=torch.bfloat16, bf16_gather=gather)
        outs.append(backend.forward(q, k, v, *(c.clone() for c in cache), backend.plan(batch)))
    assert torch.equal(*outs)
    assert calls == ([start + n] * 2 if start else []), "keys and values of a chunk after a cached prefix only"


@pytest.mark.parametrize("prefill, cache_dtype, given_it", [
    ("torch-bf16", torch.float16, True), ("torch-bf16", torch.float32, False), ("torch", torch.float16, False)])
def test_create_backend_gives_it_to_bf16_attention_over_an_fp16_cache(prefill, cache_dtype, given_it):
    backend = create_backend("torch", 8, 2, 64, 16, CPU, torch.float32, cache_dtype, prefill=prefill, bf16_rows=True)
    assert (backend.bf16_gather is not None) == given_it


EVERY_PATTERN = """
import torch
from agentserve.executor.attention import cpu_gather
from agentserve.executor.attention.torch_backend import _cast
gather = cpu_gather.load()
cache = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16).view(4096, 16, 1, 1)
blocks = torch.randperm(4096)
got, want = gather(cache, blocks, 4096 * 16 - 5, 2), _cast(cache[blocks].flatten(0, 1)[: 4096 * 16 - 5], torch.bfloat16)
nan = want.isnan()
print(torch.equal(got.isnan(), nan) and torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan]))
"""


def test_the_avx2_build_gathers_every_fp16_bit_pattern_as_pytorch(tmp_path):
    """The AVX2-only class (no AVX-512: the 8-wide loop and the scalar tail), checked on either class: a build with
    ``-mno-avx512f`` in a fresh cache and process converts all 65,536 fp16 bit patterns as PyTorch does."""
    env = {**os.environ, build.DIR_ENV: str(tmp_path), build.CFLAGS_ENV: "-mno-avx512f"}
    done = subprocess.run([sys.executable, "-c", EVERY_PATTERN], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "True"
