"""One allocator pool for every lane stream on CUDA: the executor picks PyTorch's cudaMallocAsync backend
(one stream-ordered pool per device) before CUDA starts, unless the user chose an allocator."""

from __future__ import annotations

import pytest

from agentserve.executor import process
from agentserve.executor.memory import SHARED_POOL, configure_cuda_allocator


def test_shared_pool_is_chosen_when_nothing_is_set() -> None:
    """Through the old variable name: the only one torch 2.9-2.11 reads CUDA-only keys from (pytorch#183387)."""
    env: dict[str, str] = {}
    assert configure_cuda_allocator(env) == "cudaMallocAsync"
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": SHARED_POOL}


@pytest.mark.parametrize("var", ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"])
def test_a_users_allocator_setting_wins(var: str) -> None:
    env = {var: "expandable_segments:True"}
    assert configure_cuda_allocator(env) == "user"
    assert env == {var: "expandable_segments:True"}


def test_native_allocator_on_request() -> None:
    env = {"AGENTSERVE_CUDA_ALLOCATOR": "native"}
    assert configure_cuda_allocator(env) == "native"
    assert env == {"AGENTSERVE_CUDA_ALLOCATOR": "native"}
    with pytest.raises(ValueError, match="AGENTSERVE_CUDA_ALLOCATOR"):
        configure_cuda_allocator({"AGENTSERVE_CUDA_ALLOCATOR": "slab"})


def test_executor_configures_the_allocator_before_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    monkeypatch.setattr(process, "configure_cuda_allocator", lambda *a, **k: order.append("allocator") or "x")

    def runner(*a, **k):
        order.append("runner")
        raise process.EngineError("stop")

    monkeypatch.setattr(process.RingPair, "attach", staticmethod(lambda run, role: type("P", (), {
        "send": lambda self, m, timeout=None: None, "close": lambda self: None})()))
    monkeypatch.setattr(process, "ModelRunner", runner)
    assert process.run_executor(process.ExecutorOptions(run="r", model_dir="m")) == 2
    assert order == ["allocator", "runner"]
