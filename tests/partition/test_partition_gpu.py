"""The real green-ctx path on a CUDA machine (skipped cleanly without CUDA)."""

from __future__ import annotations

import pytest
import torch

from agentserve.executor.lanes import LaneWorker
from agentserve.executor.partition import detect
from agentserve.executor.partition.driver import load_driver
from agentserve.executor.partition.green_ctx import GreenCtxBackend
from agentserve.executor.partition.torch_cuda import TorchCuda
from agentserve.protocol.lanes import Lane

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_detect_picks_a_cuda_backend() -> None:
    backend = detect()
    try:
        assert backend.name in ("green-ctx", "cuda-streams"), backend.reason
        assert backend.unit == "SMs"
    finally:
        backend.close()


def test_real_green_contexts_run_disjoint_lanes() -> None:
    backend = GreenCtxBackend(load_driver(), TorchCuda(0))
    total = torch.cuda.get_device_properties(0).multi_processor_count
    try:
        assert backend.ladder[-1].decode_units == total and not backend.ladder[-1].partitioned
        assert len(backend.ladder) >= 2, backend.reason
        rung = backend.ladder[len(backend.ladder) // 2]
        assert rung.partitioned and rung.decode_units + rung.prefill_units <= total
        a = torch.randn(1024, 1024, device="cuda")
        expected = (a @ a).cpu()
        with LaneWorker(backend, Lane.DECODE, rung.index) as dec, LaneWorker(backend, Lane.PREFILL, rung.index) as pre:
            pf = pre.submit(lambda b: (torch.cuda.current_stream() == b.stream, a @ a))
            dc = dec.submit(lambda b: (torch.cuda.current_stream() == b.stream, a @ a), after=[pf.marker])
            (p_on_stream, p_out), (d_on_stream, d_out) = pf.result(60), dc.result(60)
            dc.marker.wait()
        torch.cuda.synchronize()  # the results were made on the lane streams
        assert p_on_stream and d_on_stream
        torch.testing.assert_close(p_out.cpu(), expected)
        torch.testing.assert_close(d_out.cpu(), expected)
    finally:
        backend.close()


def test_lane_threads_run_on_the_backend_device() -> None:
    index = torch.cuda.device_count() - 1
    backend = detect(cuda=TorchCuda(index))
    try:
        with LaneWorker(backend, Lane.DECODE, 0) as dec, LaneWorker(backend, Lane.PREFILL, 0) as pre:
            assert dec.submit(lambda b: torch.cuda.current_device()).result(60) == index
            assert pre.submit(lambda b: torch.cuda.current_device()).result(60) == index
    finally:
        backend.close()


def test_every_rung_is_disjoint_and_no_larger_than_reported() -> None:
    backend = GreenCtxBackend(load_driver(), TorchCuda(0))
    total = torch.cuda.get_device_properties(0).multi_processor_count
    try:
        sizes = [r.decode_units for r in backend.ladder if r.partitioned]
        assert sizes == sorted(set(sizes)), "rungs are deduplicated by their real sizes"
        assert all(r.decode_units + r.prefill_units <= total for r in backend.ladder if r.partitioned)
        assert backend.ladder[-1].decode_units == total
    finally:
        backend.close()


def test_a_device_side_assert_is_a_sticky_error(tmp_path) -> None:
    """In a child process (the assert poisons its context): the executor's classifier recognises it."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from agentserve.executor.faults import is_sticky_cuda_error\n"
        "x = torch.zeros(4, device='cuda')\n"
        "try:\n"
        "    x[torch.tensor([9], device='cuda')] = 1.0\n"
        "    torch.cuda.synchronize()\n"
        "except Exception as e:\n"
        "    print('sticky' if is_sticky_cuda_error(e) else f'not sticky: {e!r}')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "sticky" in done.stdout and "not sticky" not in done.stdout, done.stdout + done.stderr
