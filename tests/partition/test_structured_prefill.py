"""``AGENTSERVE_GREEN_PREFILL=structured``: prefill on a structured group of its own instead of the split's
remainder, which has no co-scheduling guarantee (on an H200 small bf16 products failed there).  Against the
fake driver, which forms structured groups only in multiples of the alignment."""

from __future__ import annotations

import pytest
from partition_fakes import GRANULARITY, Gpu

from agentserve.executor.partition.green_ctx import GreenCtxBackend, structured_prefill
from agentserve.protocol.lanes import Lane


@pytest.mark.parametrize(("sms", "cc"), [(132, (9, 0)), (170, (12, 0)), (64, (8, 6))])
def test_structured_prefill_groups_are_aligned_and_disjoint(monkeypatch, sms: int, cc: tuple[int, int]) -> None:
    monkeypatch.setenv("AGENTSERVE_GREEN_PREFILL", "structured")
    gpu = Gpu(sms, cc)
    backend = GreenCtxBackend(gpu.drv, gpu.cuda)
    min_size, align = GRANULARITY[cc[0]]
    partitioned = [r for r in backend.ladder if r.partitioned]
    assert partitioned and f"prefill on a structured group on {len(partitioned)} of {len(partitioned)} rungs" \
        in backend.reason
    asked = [arg for name, arg in gpu.drv.log if name == "cuDevSmResourceSplit"]
    assert asked == [[r.decode_units, r.prefill_units] for r in partitioned]
    assert gpu.drv.calls["cuDevSmResourceSplitByCount"] == 0
    for r in partitioned:
        assert r.prefill_units % align == 0 and r.prefill_units >= min_size
        assert sms - align < r.decode_units + r.prefill_units <= sms
        decode, prefill = gpu.lane_sms(backend, r.index)
        assert (len(decode), len(prefill)) == (r.decode_units, r.prefill_units) and not decode & prefill
    backend.close()
    assert not gpu.drv.live_contexts and not gpu.violations


def test_without_a_pair_split_prefill_takes_the_remainder(monkeypatch) -> None:
    """A driver whose pair split fails keeps today's layout: decode group plus remainder."""
    monkeypatch.setenv("AGENTSERVE_GREEN_PREFILL", "structured")
    gpu = Gpu(132, (9, 0), {"fail": {"cuDevSmResourceSplit": gpu_error()}})
    backend = GreenCtxBackend(gpu.drv, gpu.cuda)
    assert all(r.decode_units + r.prefill_units == 132 for r in backend.ladder if r.partitioned)
    assert gpu.drv.calls["cuDevSmResourceSplitByCount"] == len(backend.ladder) - 1
    assert f"structured group on 0 of {len(backend.ladder) - 1} rungs" in backend.reason
    assert "16 SMs: prefill on the remainder" in backend.reason, "each rung that fell back says so"
    backend.close()


def test_the_default_is_the_remainder(monkeypatch) -> None:
    monkeypatch.delenv("AGENTSERVE_GREEN_PREFILL", raising=False)
    gpu = Gpu(132, (9, 0))
    backend = GreenCtxBackend(gpu.drv, gpu.cuda)
    assert all(r.decode_units + r.prefill_units == 132 for r in backend.ladder if r.partitioned)
    assert "structured" not in backend.reason and backend.stream_for(Lane.PREFILL, 0) is not None
    backend.close()


def test_an_unknown_setting_is_refused() -> None:
    assert structured_prefill({"AGENTSERVE_GREEN_PREFILL": "structured"})
    assert not structured_prefill({})
    with pytest.raises(ValueError, match="AGENTSERVE_GREEN_PREFILL"):
        structured_prefill({"AGENTSERVE_GREEN_PREFILL": "aligned"})


def gpu_error():
    from partition_fakes import CUresult

    return CUresult.CUDA_ERROR_NOT_SUPPORTED
