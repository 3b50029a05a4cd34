"""Section ``memory``: memory peaks with PyTorch's caching allocator vs the shared cudaMallocAsync pool.

The allocator backend is fixed when a process first touches CUDA, so each runs in a child process
(``gpu_probe.py --memory-worker native|shared``): the ~1B model, the KV budget the profiling step gives,
then an 8k-token prefill on every rung's prefill stream and a decode batch on every decode stream, with
reserved and device-used memory after each.  With one cache per stream the reserve grows with the rungs
used; with the shared pool it should not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from probe.common import Context

SHAPE = {"batch": 32, "context": 512, "prefill": 8192}


def worker(device: str, allocator: str, out_file: Path) -> int:
    """The child: measure under ``allocator`` and write one JSON object to ``out_file``."""
    from agentserve.executor.memory import configure_cuda_allocator, keep_lanes_independent

    os.environ["AGENTSERVE_CUDA_ALLOCATOR"] = "native" if allocator == "native" else "shared"
    chosen = configure_cuda_allocator()
    import lane_check
    import torch

    from agentserve.executor.lanes import LaneWorker
    from agentserve.executor.memory import CudaMemory, profile_memory
    from agentserve.executor.partition import detect
    from agentserve.executor.partition.torch_cuda import TorchCuda, device_index
    from agentserve.protocol.lanes import Lane
    from probe.model import Shape, build_runner

    shape = Shape(SHAPE["batch"], SHAPE["context"], SHAPE["prefill"], steps=1)
    runner = build_runner(device, shape)
    dev = torch.device(device)
    pool = keep_lanes_independent(device_index(dev))
    profile = profile_memory(CudaMemory(dev), lambda: runner.profile_step(runner.profile_tokens))
    blocks = runner.profiled_num_blocks(CudaMemory(dev), runner.memory_utilization)
    backend = detect(cuda=TorchCuda(device_index(dev)))
    wl = lane_check.Workload(runner, shape.batch, shape.context, shape.prefill, shape.prefill)
    rows = []
    try:
        with LaneWorker(backend, Lane.DECODE, backend.ladder[-1].index) as dec:
            dec.submit(wl.warm).result()
        for rung in backend.ladder:
            with LaneWorker(backend, Lane.PREFILL, rung.index) as pre:
                pre.submit(wl.prefill_chunk(0)).result()
            with LaneWorker(backend, Lane.DECODE, rung.index) as d:
                d.submit(wl.decode).result()
            free, total = torch.cuda.mem_get_info(dev)
            rows.append({"rung": rung.index, "reserved_gib": round(torch.cuda.memory_reserved(dev) / 2**30, 3),
                         "device_used_gib": round((total - free) / 2**30, 3)})
    finally:
        backend.close()
    out = {"allocator": chosen, "backend": torch.cuda.memory.get_allocator_backend(), "pool": pool,
           "profile_gib": {k: round(v / 2**30, 3) for k, v in profile.__dict__.items()},
           "kv_blocks_from_profile": blocks, "kv_gib_from_profile": round(blocks * runner.bytes_per_block / 2**30, 2),
           "peak_allocated_gib": round(torch.cuda.max_memory_allocated(dev) / 2**30, 3),
           "after_each_rung": rows, "partition_backend": backend.name}
    out_file.write_text(json.dumps(out))
    return 0


def _child(ctx: Context, allocator: str, timeout: float, extra: list[str]) -> dict[str, Any]:
    out_file = ctx.out / f"memory_{allocator}.json"
    cmd = [sys.executable, str(ctx.repo / "scripts" / "gpu_probe.py"), "--memory-worker", allocator,
           "--device", ctx.device, "--out", str(out_file), *extra]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout, 1), env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s"}
    if done.returncode != 0 or not out_file.exists():
        return {"error": f"exit {done.returncode}", "stderr_tail": done.stderr[-2000:]}
    return {**json.loads(out_file.read_text()), "seconds": round(time.monotonic() - t0, 1)}


def memory(ctx: Context, deadline: float) -> dict[str, Any]:
    results = {}
    for i, allocator in enumerate(("native", "shared")):
        share = (deadline - time.monotonic()) / (2 - i)
        results[allocator] = _child(ctx, allocator, share, [])
    return results


def memory_dry(ctx: Context, deadline: float) -> dict[str, Any]:
    """The parent's side on the CPU: the child command and the allocator each would choose."""
    from agentserve.executor.memory import configure_cuda_allocator

    chosen = {mode: configure_cuda_allocator({"AGENTSERVE_CUDA_ALLOCATOR": mode}) for mode in ("native", "shared")}
    return {"children": ["--memory-worker native", "--memory-worker shared"], "allocators": chosen,
            "shape": SHAPE}
