"""ModelRunner settings and input validation: dtypes, KV sizing, typed errors for bad requests."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import hf_logits

from agentserve.executor.errors import EngineError, InvalidRequestError, PromptTooLongError
from agentserve.executor.kv_cache import KVCache, bytes_per_block
from agentserve.executor.runner import DecodeItem, ModelRunner, PrefillChunk


@pytest.fixture(scope="module")
def runner(cases) -> ModelRunner:
    return ModelRunner(cases["llama_tied"].path, dtype="float32", device="cpu", num_blocks=8, block_size=4,
                       max_model_len=24)


def test_kv_cache_sizing():
    per = bytes_per_block(num_layers=2, block_size=16, num_kv_heads=2, head_dim=32, dtype=torch.bfloat16)
    assert per == 2 * 2 * 16 * 2 * 32 * 2
    cache = KVCache.from_budget(10 * per + 1, 2, 16, 2, 32, torch.bfloat16, torch.device("cpu"))
    assert (cache.num_blocks, cache.capacity_tokens, cache.bytes_per_block) == (10, 160, per)
    assert cache.k[1].shape == (10, 16, 2, 32) and len(cache.v) == 2


def test_runner_kv_budget_and_attributes(cases):
    r = ModelRunner(cases["qwen3_headdim"].path, dtype="float32", device="cpu", kv_cache_bytes=1 << 20)
    per = bytes_per_block(2, 16, 2, 32, torch.float32)
    assert r.num_blocks == (1 << 20) // per and r.capacity_tokens == r.num_blocks * 16
    assert r.bytes_per_block == per and r.max_model_len == 512 and r.device.type == "cpu"
    with pytest.raises(EngineError, match="smaller than one block"):
        ModelRunner(cases["qwen3_headdim"].path, dtype="float32", device="cpu", kv_cache_bytes=100)


def test_dtype_choice(cases):
    path = cases["llama_tied"].path
    auto = ModelRunner(path, device="cpu", num_blocks=2)
    assert auto.dtype == torch.float32  # on a CPU: fp32 activations (bf16 products where native: weights=auto)
    with pytest.raises(EngineError, match="float16"):
        ModelRunner(path, dtype="float16", device="cpu", num_blocks=2)
    with pytest.raises(EngineError, match="unknown dtype"):
        ModelRunner(path, dtype="int8", device="cpu", num_blocks=2)
    with pytest.raises(EngineError, match="attention backend"):
        ModelRunner(path, dtype="float32", device="cpu", num_blocks=2, attention_backend="nope")


def test_bf16_logits_close_to_fp32_oracle(cases):
    case = cases["qwen2_tied_bias"]
    r = ModelRunner(case.path, dtype="bfloat16", device="cpu", num_blocks=8)
    tokens = case.prompts[2]
    got = r.prefill([PrefillChunk(tokens, 0, list(range(8)))], all_logits=True)[0]
    ref = hf_logits(case.hf, tokens)
    assert got.dtype == torch.float32
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 0.05
    dec = r.decode([DecodeItem(3, len(tokens), list(range(8)))])
    ref_dec = hf_logits(case.hf, tokens + [3])[-1]
    assert ((dec[0] - ref_dec).abs().max() / ref_dec.abs().max()).item() < 0.05


def test_too_long(runner):
    with pytest.raises(PromptTooLongError, match="24"):
        runner.prefill([PrefillChunk(list(range(25)), 0, list(range(8)))])
    with pytest.raises(PromptTooLongError):
        runner.prefill([PrefillChunk([1, 2], 23, list(range(8)))])
    with pytest.raises(PromptTooLongError):
        runner.decode([DecodeItem(1, 24, list(range(8)))])


def test_bad_requests(runner):
    with pytest.raises(InvalidRequestError, match="block table has 2 blocks"):
        runner.prefill([PrefillChunk(list(range(9)), 0, [0, 1])])
    with pytest.raises(InvalidRequestError, match="block table"):
        runner.decode([DecodeItem(1, 8, [0, 1])])
    with pytest.raises(InvalidRequestError, match="block id"):
        runner.prefill([PrefillChunk([1, 2], 0, [8])])
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        runner.prefill([PrefillChunk([1, 300], 0, [0])])
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        runner.decode([DecodeItem(-1, 0, [0])])
    with pytest.raises(InvalidRequestError, match="empty"):
        runner.prefill([PrefillChunk([], 0, [0])])
    with pytest.raises(InvalidRequestError):
        runner.prefill([])
    with pytest.raises(InvalidRequestError):
        runner.decode([])
    with pytest.raises(InvalidRequestError, match="negative"):
        runner.decode([DecodeItem(1, -1, [0])])


def test_failed_request_leaves_cache_untouched(runner):
    before = [k.clone() for k in runner.kv_cache.k]
    with pytest.raises(InvalidRequestError):
        runner.prefill([PrefillChunk([1, 2], 0, [0]), PrefillChunk([5], 0, [99])])
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_cache.k, strict=True))


def test_cuda_request_without_cuda_is_clear(cases):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: nothing to refuse")
    with pytest.raises(EngineError, match="CUDA is not available"):
        ModelRunner(cases["llama_tied"].path, device="cuda", num_blocks=2)
