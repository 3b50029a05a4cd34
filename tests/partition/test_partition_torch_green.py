"""torch.cuda.green_contexts as a fallback, against a fake GreenContext with the real rule: every
``create`` runs its own split, so two contexts made by two calls share SMs (pytorch#195378)."""

from __future__ import annotations

import pytest
import torch
from partition_fakes import CUresult, FakeStream, Gpu

from agentserve.executor.partition import detect


class FakeGreenContext:
    """One ``create`` = one independent split: its SMs are the first ``roundup(num_sms, 8)`` of the device."""

    made: list[FakeGreenContext] = []

    def __init__(self, num_sms: int) -> None:
        self.sms = frozenset(range(-(-num_sms // 8) * 8))
        self.stream = FakeStream("green", priority=0)

    @staticmethod
    def create(*, num_sms: int | None = None, device_id: int | None = None, **_: object) -> FakeGreenContext:
        ctx = FakeGreenContext(num_sms or 0)
        FakeGreenContext.made.append(ctx)
        return ctx

    def Stream(self) -> FakeStream:  # noqa: N802 - torch's name
        return self.stream


@pytest.fixture
def fake_torch_green(monkeypatch: pytest.MonkeyPatch) -> type[FakeGreenContext]:
    FakeGreenContext.made = []
    monkeypatch.setattr(torch.cuda.green_contexts, "GreenContext", FakeGreenContext)
    monkeypatch.setattr(torch.cuda.green_contexts, "SUPPORTED", True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    return FakeGreenContext


def test_separate_creates_are_never_reported_as_partitions(fake_torch_green: type[FakeGreenContext]) -> None:
    """The driver path fails; torch can only make contexts from separate splits, which overlap."""
    gpu = Gpu(132, (9, 0), {"fail": {"cuGreenCtxCreate": CUresult.CUDA_ERROR_NOT_SUPPORTED}})
    backend = detect(driver=gpu.drv, cuda=gpu.cuda)
    try:
        for rung in backend.ladder:
            if rung.partitioned and backend.name == "green-ctx":
                made = fake_torch_green.made
                dec, pre = made[2 * rung.index].sms, made[2 * rung.index + 1].sms
                assert not dec & pre, f"rung {rung.index} reported partitioned, lanes share {len(dec & pre)} SMs"
        assert not backend.partitioned
        assert backend.name == "cuda-streams"
        assert "cuGreenCtxCreate returned CUDA_ERROR_NOT_SUPPORTED (801)" in backend.reason
        assert "pytorch#195378" in backend.reason and "pip install" in backend.reason
        assert [(r.decode_units, r.prefill_units) for r in backend.ladder] == [(132, 132)], "the real sizes"
    finally:
        backend.close()


def test_cpu_torch_build_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda.green_contexts, "SUPPORTED", False)
    gpu = Gpu(132, (9, 0), {"fail": {"cuInit": CUresult.CUDA_ERROR_NO_DEVICE}})
    backend = detect(driver=gpu.drv, cuda=gpu.cuda)
    assert "torch.cuda.green_contexts" in backend.reason
    backend.close()
