"""Decode CUDA graphs on a GPU: replay equals eager decode, one set per rung on its own stream, release."""

from __future__ import annotations

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
