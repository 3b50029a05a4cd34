"""The torch.cuda.green_contexts path, against a fake GreenContext class (the CPU build's real one raises)."""

from __future__ import annotations

import pytest
import torch
from partition_fakes import CUresult, FakeStream, Gpu

from agentserve.executor.partition import detect, torch_green
from agentserve.executor.partition.torch_green import TorchGreenCtxBackend
from agentserve.protocol.lanes import Lane


class FakeGreenContext:
    made: list[FakeGreenContext] = []

    def __init__(self, num_sms: int) -> None:
        self.num_sms = num_sms
        self.stream = FakeStream("green", priority=0)

    @staticmethod
    def create(*, num_sms: int | None = None, device_id: int | None = None, **_: object) -> FakeGreenContext:
        ctx = FakeGreenContext(num_sms)
        FakeGreenContext.made.append(ctx)
        return ctx

    def Stream(self) -> FakeStream:  # noqa: N802 - torch's name
        return self.stream


@pytest.fixture
def fake_torch_green(monkeypatch: pytest.MonkeyPatch) -> type[FakeGreenContext]:
    FakeGreenContext.made = []
    monkeypatch.setattr(torch_green, "_green_context_class", lambda: FakeGreenContext)
    monkeypatch.setattr(torch.cuda.green_contexts, "SUPPORTED", True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    return FakeGreenContext


def test_torch_green_contexts_build_the_cc_ladder(fake_torch_green: type[FakeGreenContext]) -> None:
    gpu = Gpu(132, (9, 0))
    backend = TorchGreenCtxBackend(gpu.cuda)
    sizes = [r.decode_units for r in backend.ladder if r.partitioned]
    assert sizes == [16, 24, 40, 56, 64, 80, 96, 104, 120]
    assert [c.num_sms for c in fake_torch_green.made] == [n for d in sizes for n in (d, 132 - d)]
    assert "may overlap" in backend.reason and "table, not queried" in backend.reason
    with backend.lane_context(Lane.PREFILL, 0) as b:
        assert gpu.cuda.current() is b.stream is fake_torch_green.made[1].stream and b.units == 116
    backend.close()
    assert all(c.stream.synced == 1 for c in fake_torch_green.made)


def test_driver_failure_falls_to_torch_green_contexts(fake_torch_green: type[FakeGreenContext]) -> None:
    gpu = Gpu(132, (9, 0), {"fail": {"cuGreenCtxCreate": CUresult.CUDA_ERROR_NOT_SUPPORTED}})
    backend = detect(driver=gpu.drv, cuda=gpu.cuda)
    assert backend.name == "green-ctx"
    assert backend.reason.startswith(
        "green-ctx: cuda.bindings: cuGreenCtxCreate returned CUDA_ERROR_NOT_SUPPORTED (801); "
        "using torch.cuda.green_contexts"
    )
    backend.close()
