"""Decode graphs' static-buffer path on a CPU: captured with a stand-in that re-runs the function (no CUDA),
the Triton kernels in the interpreter.  A replayed step must give eager decode's logits and write the KV
cache where eager decode does (padding rows write nothing)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))

from engine_helpers import build_hf_model, random_prompts, save_checkpoint  # noqa: E402

from agentserve.executor.runner import DecodeItem, ModelRunner, PrefillChunk  # noqa: E402


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> ModelRunner:
    path = save_checkpoint(build_hf_model("llama_tied"), tmp_path_factory.mktemp("graph_ckpt") / "llama")
    r = ModelRunner(path, dtype="float32", device="cpu", num_blocks=48, block_size=4, attention_backend="triton")
    assert r.graphs_unavailable() == "not on CUDA"
    r.graphs_wanted, r.graph_max_batch = True, 4  # the graph path, small: the interpreter is slow
    assert r.graphs_unavailable() is None
    return r


def snapshot(r: ModelRunner) -> list[torch.Tensor]:
    return [t.clone() for t in r.kv_cache.k + r.kv_cache.v]


def restore(r: ModelRunner, saved: list[torch.Tensor]) -> None:
    for t, s in zip(r.kv_cache.k + r.kv_cache.v, saved, strict=True):
        t.copy_(s)


def test_replay_equals_eager_decode(runner):
    prompts = random_prompts([6, 13, 3], seed=5)
    tables = [list(range(i * 16, (i + 1) * 16)) for i in range(3)]
    runner.prefill([PrefillChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    before = snapshot(runner)
    assert runner.capture_graphs(rung=0, sm_count=4) == 3  # buckets 4, 2, 1
    assert all(torch.equal(a, b) for a, b in zip(snapshot(runner), before, strict=True))  # capture wrote nothing

    items = [DecodeItem(t, len(p), tb) for t, p, tb in zip([11, 22, 33], prompts, tables, strict=True)]
    replayed = runner.decode(items, rung=0).clone()  # 3 rows in the bucket of 4: one padding row
    after_replay = snapshot(runner)
    restore(runner, before)
    eager = runner.decode(items)  # no rung: eager
    assert torch.allclose(replayed, eager, atol=1e-5, rtol=1e-5)
    eager_cache = snapshot(runner)
    for got, want, old in zip(after_replay, eager_cache, before, strict=True):
        # the same slots written (none by the padding row), the same values up to a batch of 4's rounding
        written = (got != old).any(-1).any(-1).flatten().nonzero().flatten().tolist()
        assert written == (want != old).any(-1).any(-1).flatten().nonzero().flatten().tolist()
        assert len(written) == 3
        assert torch.allclose(got, want, atol=1e-5)

    assert runner.graphs._vec.shape == (4, 4)  # static buffers sized by the largest bucket
    runner.drop_graphs()
    assert runner.graphs is None
