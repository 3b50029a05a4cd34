"""The whole model on the Triton backend (CPU interpreter) against transformers: greedy tokens and logits."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))

from engine_helpers import (  # noqa: E402
    REL_TOL,
    build_hf_model,
    greedy_generate,
    hf_greedy,
    hf_logits,
    random_prompts,
    rel_err,
    save_checkpoint,
)

from agentserve.executor.attention.triton_backend import TritonAttention  # noqa: E402
from agentserve.executor.runner import ModelRunner, PrefillChunk  # noqa: E402


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A 2-layer GQA model with head size 32 (4 heads, 2 KV heads)."""
    hf = build_hf_model("qwen3_headdim")
    return hf, save_checkpoint(hf, tmp_path_factory.mktemp("triton_ckpt") / "qwen3")


def runner_for(path, block_size: int = 4) -> ModelRunner:
    runner = ModelRunner(path, dtype="float32", device="cpu", num_blocks=64, block_size=block_size,
                         attention_backend="triton")
    assert isinstance(runner.attention, TritonAttention)
    return runner


def test_greedy_batch_matches_transformers(qwen3):
    hf, path = qwen3
    prompts = random_prompts([5, 23], seed=3)
    got = greedy_generate(runner_for(path), prompts, 6, chunk_size=9)
    assert got == [hf_greedy(hf, p, 6) for p in prompts]


def test_prefill_logits_after_a_cached_prefix(qwen3):
    hf, path = qwen3
    tokens = random_prompts([30], seed=4)[0]
    runner = runner_for(path, block_size=3)
    table = list(range(20))[::-1]  # scattered: blocks in reverse order
    runner.prefill([PrefillChunk(tokens[:17], 0, table)])
    got = runner.prefill([PrefillChunk(tokens[17:], 17, table)], all_logits=True)[0]
    assert rel_err(got, hf_logits(hf, tokens)[17:]) < REL_TOL
    assert got.dtype == torch.float32
