"""KV cache sizing on CUDA from a profiling step (weights loaded, one prefill chunk and one decode batch
run), not half of whatever memory is free before any activation exists.  The CUDA memory calls sit behind
a small seam, so the arithmetic and the profiling step are checked here on the CPU."""

from __future__ import annotations

import pytest
import torch

from agentserve.executor.builtin import resolve_model
from agentserve.executor.memory import MemoryProfile, kv_budget_bytes, profile_memory
from agentserve.executor.runner import DEFAULT_MAX_SEQS, ModelRunner

GiB = 1 << 30


class FakeMemory:
    """torch.cuda's memory calls for one device; a step's activations raise the peak by ``activation``."""

    def __init__(self, total: int, others: int, weights: int, activation: int, cached: int) -> None:
        self.total, self.others, self.weights = total, others, weights
        self.activation, self.cached = activation, cached
        self._peak = weights
        self.calls: list[str] = []

    def synchronize(self) -> None:
        self.calls.append("synchronize")

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")

    def reset_peak(self) -> None:
        self.calls.append("reset_peak")
        self._peak = self.weights

    def allocated(self) -> int:
        return self.weights

    def peak_allocated(self) -> int:
        return self._peak

    def reserved(self) -> int:
        return self.weights + self.cached

    def info(self) -> tuple[int, int]:
        return self.total - self.others - self.reserved(), self.total

    def run(self) -> None:
        self._peak = self.weights + self.activation


def test_budget_from_a_profile() -> None:
    mem = FakeMemory(total=80 * GiB, others=2 * GiB, weights=16 * GiB, activation=5 * GiB, cached=6 * GiB)
    profile = profile_memory(mem, mem.run)
    assert profile == MemoryProfile(total=80 * GiB, free=56 * GiB, reserved=22 * GiB, allocated=16 * GiB,
                                    peak=5 * GiB)
    assert mem.calls.index("reset_peak") < mem.calls.index("synchronize", 1)
    # 90 % of the device, less what others hold (context, other processes), weights and the activation peak
    assert kv_budget_bytes(profile, 0.9) == int(72 * GiB) - 2 * GiB - 16 * GiB - 5 * GiB
    assert kv_budget_bytes(profile, 0.2) < 0


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(resolve_model("tiny"), dtype="float32", device="cpu", num_blocks=32)


def _profiled(runner: ModelRunner, mem: FakeMemory, utilization: float, monkeypatch) -> int:
    """``profiled_num_blocks`` with the fake seeing the real profiling step's activations."""
    step = runner.profile_step
    monkeypatch.setattr(runner, "profile_step", lambda tokens: (step(tokens), mem.run()))
    return runner.profiled_num_blocks(mem, utilization)


def test_profiled_num_blocks_uses_the_profile_not_half_of_free_memory(runner: ModelRunner, monkeypatch) -> None:
    per, MiB = runner.bytes_per_block, 1 << 20
    full = DEFAULT_MAX_SEQS * -(-runner.max_model_len // runner.block_size)
    others, weights, activation = 512 * MiB, 1024 * MiB, 256 * MiB
    wanted = (full // 2) * per  # a budget the full-length cap does not hide
    total = int((wanted + others + weights + activation) / 0.9) + 1
    mem = FakeMemory(total=total, others=others, weights=weights, activation=activation, cached=64 * MiB)
    blocks = _profiled(runner, mem, 0.9, monkeypatch)
    assert blocks == (int(total * 0.9) - others - weights - activation) // per
    assert full // 2 - 1 <= blocks < full
    free_half = (total - others - weights - 64 * MiB) // 2 // per  # what half of free memory would give
    assert blocks != free_half
    assert mem.calls.count("reset_peak") == 1


def test_profiled_num_blocks_refuses_when_nothing_is_left(runner: ModelRunner, monkeypatch) -> None:
    from agentserve.executor.errors import EngineError

    mem = FakeMemory(total=24 * GiB, others=2 * GiB, weights=16 * GiB, activation=5 * GiB, cached=0)
    with pytest.raises(EngineError, match="no memory left for the KV cache"):
        _profiled(runner, mem, 0.9, monkeypatch)


def test_profile_step_runs_a_full_chunk_and_a_full_batch_then_restores_the_cache(runner: ModelRunner) -> None:
    seen: list[tuple[str, int]] = []
    prefill, decode = runner.prefill, runner.decode
    cache, blocks = runner.kv_cache, runner.num_blocks
    runner.prefill = lambda chunks, **kw: (seen.append(("prefill", sum(len(c.token_ids) for c in chunks))),
                                           prefill(chunks, **kw))[1]
    runner.decode = lambda items: (seen.append(("decode", len(items))), decode(items))[1]
    try:
        runner.profile_step(tokens=100)
    finally:
        del runner.prefill, runner.decode
    assert seen == [("prefill", 100), ("decode", DEFAULT_MAX_SEQS)]
    assert runner.kv_cache is cache and runner.num_blocks == blocks
    assert all(bool((k == 0).all()) for k in runner.kv_cache.k), "the real cache was not written"


def test_cpu_sizing_is_unchanged() -> None:
    r = ModelRunner(resolve_model("tiny"), dtype="float32", device="cpu")
    full = DEFAULT_MAX_SEQS * -(-r.max_model_len // r.block_size)
    assert r.num_blocks == full or r.num_blocks * r.bytes_per_block <= 2 << 30
    assert isinstance(r.kv_cache.k[0], torch.Tensor)


def test_the_cpu_cache_takes_its_share_of_the_ram_up_to_its_cap(monkeypatch) -> None:
    from agentserve.executor import runner as runner_module
    from agentserve.executor.errors import EngineError

    monkeypatch.setattr(runner_module, "_available_ram", lambda: 64 * 2**20)
    model = resolve_model("tiny")
    share = ModelRunner(model, dtype="float32", cpu_kv_fraction=0.25)
    assert share.num_blocks == min(16 * 2**20 // share._per_block, share._full_blocks)
    capped = ModelRunner(model, dtype="float32", cpu_kv_cap_bytes=5 * share._per_block)
    assert capped.num_blocks == 5
    with pytest.raises(EngineError, match="kv_cache_fraction"):
        ModelRunner(model, dtype="float32", cpu_kv_fraction=1.5)
