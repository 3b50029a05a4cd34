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
