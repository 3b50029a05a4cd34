"""Detection order and error injection: every failure falls back to the next backend with a named reason."""

from __future__ import annotations

import pytest
from partition_fakes import CUresult, FakeCuda, Gpu

from agentserve.executor.partition import detect
from agentserve.executor.partition.base import BackendUnavailable
from agentserve.executor.partition.green_ctx import GreenCtxBackend


def detect_on(gpu: Gpu, prefer: str | None = None):
    return detect(prefer, driver=gpu.drv, cuda=gpu.cuda)


def test_green_ctx_chosen_when_everything_works() -> None:
    gpu = Gpu(132, (9, 0))
    backend = detect_on(gpu)
    assert backend.name == "green-ctx" and backend.partitioned
    assert backend.reason.startswith("green-ctx: CUDA Green Contexts (driver CUDA 13.0): 132 SMs")
    assert backend.device == "cuda:0 Fake GPU"
    backend.close()
    assert not gpu.drv.live_streams and not gpu.drv.live_contexts


@pytest.mark.parametrize(
    ("fname", "code"),
    [
        ("cuDeviceGetDevResource", CUresult.CUDA_ERROR_INVALID_RESOURCE_TYPE),
        ("cuDevSmResourceSplitByCount", CUresult.CUDA_ERROR_NOT_SUPPORTED),
        ("cuDevResourceGenerateDesc", CUresult.CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION),
        ("cuGreenCtxCreate", CUresult.CUDA_ERROR_NOT_SUPPORTED),
    ],
)
def test_cuda_error_falls_back_to_streams(fname: str, code: CUresult) -> None:
    gpu = Gpu(132, (9, 0), {"fail": {fname: code}})
    backend = detect_on(gpu)
    assert backend.name == "cuda-streams" and not backend.partitioned
    expected = f"green-ctx unavailable: cuda.bindings: {fname} returned {code.name} ({int(code)})"
    assert expected in backend.reason
    assert "torch.cuda.green_contexts" in backend.reason  # the torch path was tried too, and said why not
    assert backend.reason.endswith("cuda-streams: two CUDA streams (decode priority -5, prefill 0); not partitioned")
    assert [(r.decode_units, r.prefill_units, r.partitioned) for r in backend.ladder] == [(132, 132, False)]
    assert not gpu.drv.live_streams and not gpu.drv.live_contexts, "a failed build tears down what it made"
    assert not gpu.violations
    backend.close()


def test_failure_midway_tears_down_earlier_rungs_in_order() -> None:
    gpu = Gpu(132, (9, 0), {"fail_on_call": {"cuGreenCtxCreate": 5}})
    with pytest.raises(BackendUnavailable, match="cuGreenCtxCreate returned CUDA_ERROR_NOT_SUPPORTED"):
        GreenCtxBackend(gpu.drv, gpu.cuda)
    assert gpu.drv.calls["cuStreamDestroy"] == 4 and gpu.drv.calls["cuGreenCtxDestroy"] == 4
    assert not gpu.drv.live_streams and not gpu.drv.live_contexts and not gpu.violations


def test_no_way_to_make_streams_falls_back() -> None:
    gpu = Gpu(132, (9, 0))
    gpu.drv.without("cuGreenCtxStreamCreate", "cuCtxFromGreenCtx")
    backend = detect_on(gpu)
    assert backend.name == "cuda-streams"
    assert "cuGreenCtxStreamCreate is missing from the installed cuda-bindings" in backend.reason
    assert "cuCtxFromGreenCtx is missing" in backend.reason
    assert gpu.drv.calls["cuGreenCtxCreate"] == 0, "symbols are checked before anything is created"


def test_stream_fallback_not_exported_by_driver_falls_back() -> None:
    gpu = Gpu(132, (9, 0), {"not_exported": {"cuGreenCtxStreamCreate", "cuStreamCreateWithPriority"}})
    backend = detect_on(gpu)
    assert backend.name == "cuda-streams"
    assert "cuGreenCtxStreamCreate is not exported by the driver" in backend.reason
    assert "CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND" in backend.reason


def test_stream_create_refused_at_run_time_uses_the_fallback() -> None:
    gpu = Gpu(132, (9, 0), {"fail": {"cuGreenCtxStreamCreate": CUresult.CUDA_ERROR_NOT_SUPPORTED}})
    backend = detect_on(gpu)
    assert backend.name == "green-ctx" and backend.partitioned
    assert "streams from cuCtxFromGreenCtx" in backend.reason
    backend.close()
    assert not gpu.drv.live_streams and not gpu.drv.live_contexts and not gpu.violations


def test_old_driver_falls_back_with_version() -> None:
    gpu = Gpu(132, (9, 0), {"version": 12020})
    backend = detect_on(gpu)
    assert backend.name == "cuda-streams"
    assert "driver supports CUDA 12.2; green contexts need >= 12.4" in backend.reason


def test_cuinit_raising_falls_back() -> None:
    gpu = Gpu(132, (9, 0), {"raises": {"cuInit": OSError("libcuda.so.1: cannot open shared object file")}})
    gpu.cuda.available = False
    backend = detect_on(gpu)
    assert backend.name == "cpu-cores"
    assert "cuInit raised OSError: libcuda.so.1" in backend.reason
    assert "cuda-streams unavailable: fake: no CUDA device" in backend.reason
    backend.close()


def test_verification_mismatch_falls_back() -> None:
    gpu = Gpu(132, (9, 0), {"misreport_sms": 2})
    backend = detect_on(gpu)
    assert backend.name == "cuda-streams"
    assert "cuGreenCtxGetDevResource reports 18 SMs, the split gave 16" in backend.reason


def test_prefer_skips_earlier_backends() -> None:
    gpu = Gpu(132, (9, 0))
    backend = detect_on(gpu, prefer="cpu-cores")
    assert backend.name == "cpu-cores" and gpu.drv.calls["cuInit"] == 0
    with pytest.raises(ValueError, match="unknown partition backend"):
        detect_on(gpu, prefer="mps")


def test_this_machine_ends_in_cpu_cores_with_both_reasons() -> None:
    """Real cuda-bindings and real torch here: cuInit raises, torch's GreenContext raises on a CPU build."""
    import torch

    backend = detect()
    try:
        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA; the real path is covered by the gpu test")
        assert backend.name == "cpu-cores"
        assert "green-ctx unavailable: cuda.bindings: cuInit raised" in backend.reason
        assert "torch.cuda.green_contexts" in backend.reason
        assert "cuda-streams unavailable" in backend.reason
    finally:
        backend.close()


def test_streams_backend_needs_cuda() -> None:
    gpu = Gpu(132, (9, 0), {"fail": {"cuInit": CUresult.CUDA_ERROR_NO_DEVICE}})
    gpu.cuda = FakeCuda(132, available=False)
    backend = detect_on(gpu)
    assert backend.name == "cpu-cores"
    assert "cuInit returned CUDA_ERROR_NO_DEVICE (100)" in backend.reason
