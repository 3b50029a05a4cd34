"""KV sizing from the profiling step, and the shared allocator pool, on a real GPU (skipped without CUDA)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from agentserve.executor.builtin import resolve_model
from agentserve.executor.runner import DEFAULT_MAX_SEQS, ModelRunner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_kv_cache_fits_the_profiled_budget() -> None:
    runner = ModelRunner(resolve_model("bench"), device="cuda", dtype="bfloat16", profile_tokens=2048)
    free, total = torch.cuda.mem_get_info()
    full = DEFAULT_MAX_SEQS * -(-runner.max_model_len // runner.block_size)
    assert 1 <= runner.num_blocks <= full
    assert torch.cuda.memory_allocated() <= 0.9 * total
    del runner
    torch.cuda.empty_cache()


def test_lane_streams_share_one_pool_with_cuda_malloc_async() -> None:
    """A child process (the backend is fixed per process): memory freed on one stream serves another."""
    code = (
        "from agentserve.executor.memory import configure_cuda_allocator\n"
        "configure_cuda_allocator()\n"
        "import torch\n"
        "assert torch.cuda.memory.get_allocator_backend() == 'cudaMallocAsync'\n"
        "streams = [torch.cuda.Stream() for _ in range(8)]\n"
        "free0 = torch.cuda.mem_get_info()[0]\n"
        "for s in streams:\n"
        "    with torch.cuda.stream(s):\n"
        "        x = torch.empty(1 << 30, dtype=torch.uint8, device='cuda')\n"
        "        x.fill_(1)\n"
        "        del x\n"
        "    s.synchronize()\n"
        "used = (free0 - torch.cuda.mem_get_info()[0]) / 2**30\n"
        "print(f'used {used:.2f}')\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if "ALLOC_CONF" not in k}
    env["AGENTSERVE_CUDA_ALLOCATOR"] = "shared"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    used = float(done.stdout.split()[-1])
    assert used < 4.0, f"8 streams x 1 GiB left {used:.2f} GiB held: the pool is not shared"
