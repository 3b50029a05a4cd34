"""The green-ctx backend against the rules a real driver enforces (see ``partition_fakes``).

Each test here names a way the backend broke on the first real GPU: short splits, driver rounding,
a missing ``cuGreenCtxStreamCreate``, the primary context, the device index, exceptions of any type.
"""

from __future__ import annotations

import threading

import pytest
from partition_fakes import FakeCuda, Gpu

from agentserve.executor.lanes import LaneWorker
from agentserve.executor.partition import detect
from agentserve.executor.partition.green_ctx import GreenCtxBackend
from agentserve.protocol.lanes import Lane


def decode_sizes(backend) -> list[int]:
    return [r.decode_units for r in backend.ladder if r.partitioned]


def check_disjoint(gpu: Gpu, backend) -> None:
    """Every partitioned rung: decode and prefill run on disjoint SM sets of exactly the reported sizes."""
    for rung in backend.ladder:
        if not rung.partitioned:
            continue
        dec, pre = gpu.lane_sms(backend, rung.index)
        assert not dec & pre, f"rung {rung.index}: lanes share SMs {sorted(dec & pre)}"
        assert (len(dec), len(pre)) == (rung.decode_units, rung.prefill_units)


def test_short_split_shrinks_the_rung_instead_of_disabling_the_backend() -> None:
    """Clusters cover only 112 of 132 SMs: the 90 % rung (120) cannot form, so it shrinks to 112."""
    gpu = Gpu(132, (9, 0), {"cluster_sms": 112})
    backend = GreenCtxBackend(gpu.drv, gpu.cuda)
    assert decode_sizes(backend) == [16, 24, 40, 56, 64, 80, 96, 104, 112]
    assert backend.ladder[-2].prefill_units == 20
    assert "asked 120 SMs, the driver formed 112" in backend.reason
    check_disjoint(gpu, backend)
    backend.close()
    assert not gpu.violations


def test_rungs_the_driver_cannot_form_are_dropped_and_deduplicated() -> None:
    gpu = Gpu(64, (9, 0), {"cluster_sms": 24})
    backend = GreenCtxBackend(gpu.drv, gpu.cuda)
    assert decode_sizes(backend) == [8, 16, 24]  # 32..56 shrink to 24: one rung, not five
    assert [r.index for r in backend.ladder] == [0, 1, 2, 3] and not backend.ladder[-1].partitioned
    assert "dropped" in backend.reason
    check_disjoint(gpu, backend)
    backend.close()
    assert not gpu.violations


def test_no_formable_rung_falls_back_with_a_reason() -> None:
    gpu = Gpu(64, (9, 0), {"cluster_sms": 0})
    backend = detect(driver=gpu.drv, cuda=gpu.cuda)
    assert backend.name == "cuda-streams"
    assert "no partitioned rung could be formed" in backend.reason
    assert not gpu.drv.live_contexts and not gpu.drv.live_streams


def test_h100_clusters_exactly_fit_the_90_percent_rung() -> None:
    gpu = Gpu(132, (9, 0), {"cluster_sms": 120})
    backend = GreenCtxBackend(gpu.drv, gpu.cuda)
    assert decode_sizes(backend)[-1] == 120 and "shrunk" not in backend.reason
    check_disjoint(gpu, backend)
    backend.close()


@pytest.mark.parametrize("how", ["not exported", "not in bindings"])
def test_streams_fall_back_to_ctx_from_green_ctx(how: str) -> None:
    """Without cuGreenCtxStreamCreate the stream is made inside the green context (pushed current)."""
    opts = {"not_exported": {"cuGreenCtxStreamCreate"}} if how == "not exported" else {}
    gpu = Gpu(132, (9, 0), opts)
    if how == "not in bindings":
        gpu.drv.without("cuGreenCtxStreamCreate")
    backend = detect(driver=gpu.drv, cuda=gpu.cuda)
    assert backend.name == "green-ctx" and backend.partitioned, backend.reason
    assert "cuCtxFromGreenCtx" in backend.reason
    check_disjoint(gpu, backend)
    assert gpu.drv.calls["cuCtxPushCurrent"] == gpu.drv.calls["cuCtxPopCurrent"] > 0
    backend.close()
    assert not gpu.drv.live_streams and not gpu.drv.live_contexts and not gpu.violations


def test_green_contexts_come_after_the_primary_context() -> None:
    gpu = Gpu(132, (9, 0))
    backend = GreenCtxBackend(gpu.drv, gpu.cuda)
    backend.close()
    assert not gpu.violations


def test_an_exception_of_any_type_falls_back_with_its_reason() -> None:
    gpu = Gpu(132, (9, 0))
    gpu.drv.CUdevResourceType = None  # old bindings: an AttributeError deep in the build
    backend = detect(driver=gpu.drv, cuda=gpu.cuda)
    assert backend.name == "cuda-streams"
    assert "AttributeError" in backend.reason
    assert not gpu.drv.live_contexts and not gpu.drv.live_streams
    backend.close()


def test_a_cuda_runtime_error_in_streams_falls_back_to_cpu() -> None:
    gpu = Gpu(132, (9, 0), {"raises": {"cuInit": RuntimeError("no driver")}})
    gpu.cuda.fail_init = "CUDA driver initialization failed, you might not have a CUDA gpu."
    backend = detect(driver=gpu.drv, cuda=gpu.cuda)
    assert backend.name == "cpu-cores"
    assert "cuda-streams unavailable: RuntimeError: CUDA driver initialization failed" in backend.reason
    backend.close()


def test_device_index_is_honoured_on_every_lane_thread() -> None:
    gpu = Gpu(132, (9, 0), index=1)
    backend = detect(driver=gpu.drv, cuda=gpu.cuda)
    assert backend.name == "green-ctx" and backend.device.startswith("cuda:1 ")
    assert ("cuDeviceGet", 1) in gpu.drv.log
    seen: list[tuple[str, int]] = []

    def where(binding) -> None:
        seen.append((threading.current_thread().name, gpu.cuda.current_device()))

    for rung in (0, backend.ladder[-1].index):
        with LaneWorker(backend, Lane.DECODE, rung) as dec, LaneWorker(backend, Lane.PREFILL, rung) as pre:
            dec.submit(where).result(10)
            pre.submit(where).result(10)
    assert {d for _, d in seen} == {1}, seen
    backend.close()
    assert not gpu.violations


def test_streams_backend_honours_the_device_index() -> None:
    cuda = FakeCuda(132, index=2)
    backend = detect("cuda-streams", cuda=cuda)
    assert backend.device.startswith("cuda:2 ")
    with LaneWorker(backend, Lane.DECODE, 0) as dec:
        assert dec.submit(lambda b: cuda.current_device()).result(10) == 2
    backend.close()


@pytest.mark.parametrize(("sms", "cc"), [(148, (10, 0)), (170, (12, 0)), (84, (8, 9))])
def test_blackwell_and_ada_granularity(sms: int, cc: tuple[int, int]) -> None:
    gpu = Gpu(sms, cc)
    backend = GreenCtxBackend(gpu.drv, gpu.cuda)
    align = 8 if cc[0] >= 9 else 2
    assert all(d % align == 0 for d in decode_sizes(backend))
    check_disjoint(gpu, backend)
    backend.close()
    assert not gpu.violations


def test_rungs_the_driver_rounds_to_one_size_are_deduplicated() -> None:
    """The driver forms 16-SM groups though the resource reports steps of 8: 56 and 64 both become 64."""
    gpu = Gpu(132, (9, 0), {"round_to": 16})
    backend = GreenCtxBackend(gpu.drv, gpu.cuda)
    sizes = decode_sizes(backend)
    assert sizes == sorted(set(sizes)), f"duplicate rungs {sizes}"
    assert sizes == [16, 32, 48, 64, 80, 96, 112, 128][: len(sizes)] and 64 in sizes
    check_disjoint(gpu, backend)
    backend.close()
