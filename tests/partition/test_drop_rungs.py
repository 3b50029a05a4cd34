"""Rungs leave the ladder (their warm-up failed on a GPU): the rest renumbered, each keeping its streams."""

from __future__ import annotations

import pytest
from partition_fakes import Gpu

from agentserve.executor.partition.cpu_cores import CpuCoresBackend
from agentserve.executor.partition.green_ctx import GreenCtxBackend
from agentserve.protocol.lanes import Lane


def test_dropped_rungs_leave_and_the_rest_keep_their_streams() -> None:
    gpu = Gpu(132, (9, 0))
    backend = GreenCtxBackend(gpu.drv, gpu.cuda)
    before = list(backend.ladder)
    streams = {r.index: {lane: backend.stream_for(lane, r.index) for lane in Lane} for r in before}
    backend.drop_rungs({1, len(before) - 2}, "rungs 1 and the last partitioned one left out")
    kept = [r for r in before if r.index not in {1, len(before) - 2}]
    assert [r.index for r in backend.ladder] == list(range(len(kept)))
    assert [(r.decode_units, r.prefill_units, r.partitioned) for r in backend.ladder] == [
        (r.decode_units, r.prefill_units, r.partitioned) for r in kept]
    for new, old in enumerate(kept):
        for lane in Lane:
            assert backend.stream_for(lane, new) is streams[old.index][lane]
        with backend.lane_context(Lane.PREFILL, new) as binding:
            assert binding.stream is streams[old.index][Lane.PREFILL] and binding.rung == backend.ladder[new]
    with pytest.raises(IndexError):
        backend.rung(len(kept))
    assert backend.reason.startswith("rungs 1 and the last partitioned one left out; ")  # first: `top` cuts the rest
    backend.close()
    assert not gpu.violations, "a dropped rung's streams and contexts are still released, streams first"


def test_the_top_rung_an_unknown_one_or_a_bound_one_cannot_be_dropped() -> None:
    gpu = Gpu(132, (9, 0))
    backend = GreenCtxBackend(gpu.drv, gpu.cuda)
    top = len(backend.ladder) - 1
    ladder = list(backend.ladder)
    for gone in ({top}, {top + 1}, {-1}):
        with pytest.raises(ValueError, match="only partitioned rungs"):
            backend.drop_rungs(gone, "x")
    with backend.lane_context(Lane.DECODE, 2), pytest.raises(ValueError, match=r"rungs \[2\] are in use"):
        backend.drop_rungs({2}, "x")
    assert backend.ladder == ladder
    backend.close()
    assert not gpu.violations


def test_a_cpu_backend_drops_nothing() -> None:
    backend = CpuCoresBackend()
    if len(backend.ladder) < 2:
        pytest.skip("one core: a single rung")
    with pytest.raises(NotImplementedError, match="cannot drop rungs"):
        backend.drop_rungs({0}, "x")
    backend.close()
