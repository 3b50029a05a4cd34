"""Decode CUDA graphs on a GPU: replay equals eager decode, one set per rung on its own stream, release."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))

from engine_helpers import build_hf_model, random_prompts, save_checkpoint  # noqa: E402

from agentserve.executor.runner import DecodeItem, ModelRunner, PrefillChunk  # noqa: E402


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> ModelRunner:
    path = save_checkpoint(build_hf_model("qwen3_headdim"), tmp_path_factory.mktemp("gpu_graph_ckpt") / "qwen3")
    r = ModelRunner(path, dtype="bfloat16", device="cuda", num_blocks=256, block_size=16,
                    attention_backend="triton")
    assert r.graphs_unavailable() is None
    return r


def test_graphs_replay_eager_decode_per_rung(runner):
    prompts = random_prompts([40, 100, 7], seed=1)
    tables = [list(range(i * 64, (i + 1) * 64)) for i in range(3)]
    runner.prefill([PrefillChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    side = torch.cuda.Stream()
    runner.capture_graphs(rung=0, sm_count=sms)  # on the default stream: captured on a side stream
    with torch.cuda.stream(side):
        runner.capture_graphs(rung=1, sm_count=sms // 2)
    assert len(runner.graphs.table) == 2 * len(runner.graphs.buckets)
    items = [DecodeItem(t, len(p), tb) for t, p, tb in zip([1, 2, 3], prompts, tables, strict=True)]
    graphed = runner.decode(items, rung=0).clone()
    with torch.cuda.stream(side):
        other = runner.decode(items, rung=1).clone()
    eager = runner.decode(items)
    for got in (graphed, other):
        assert (got - eager).abs().max().item() <= 0.05 * eager.abs().max().item()
    runner.drop_graphs()
    assert runner.graphs is None


CAPTURE_CYCLES = """
import sys
sys.path.insert(0, sys.argv[1])
from agentserve.executor.memory import configure_cuda_allocator
assert configure_cuda_allocator() == "native"  # as the executor's entry point, before torch loads
import torch
from engine_helpers import build_hf_model, save_checkpoint
from agentserve.executor.runner import DecodeItem, ModelRunner, PrefillChunk
path = save_checkpoint(build_hf_model("llama_tied"), sys.argv[2])
r = ModelRunner(path, dtype="bfloat16", device="cuda", num_blocks=64, block_size=16, attention_backend="triton")
r.prefill([PrefillChunk([1, 2, 3, 4, 5], 0, [0])])
sms = torch.cuda.get_device_properties(0).multi_processor_count
for cycle in range(2):
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        r.capture_graphs(rung=0, sm_count=sms)
        for _ in range(3):
            r.decode([DecodeItem(7, 5, [0])], rung=0)
    torch.cuda.synchronize()
    r.drop_graphs()  # most buckets were captured and never replayed
    torch.cuda.synchronize()
del r
torch.cuda.synchronize()
print("clean")
"""


def test_graph_capture_cycles_exit_cleanly(tmp_path):
    """Under the executor's allocator: capture a rung's buckets, replay one, drop them all, twice, then exit.
    A graph's memory freed wrongly aborts the process from a destructor (seen on an H200 under the
    cudaMallocAsync pool), so this runs in a child process and checks its exit and output."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF",
                                                              "AGENTSERVE_CUDA_ALLOCATOR", "TRITON_INTERPRET")}
    engine_dir = str(Path(__file__).parents[1] / "engine")
    done = subprocess.run([sys.executable, "-c", CAPTURE_CYCLES, engine_dir, str(tmp_path / "m")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.split()[-1:] == ["clean"], done.stderr[-3000:]
