"""Teardown order (streams before contexts) and no stream released while a lane is bound to it."""

from __future__ import annotations

import random
import threading
import time

import pytest
from partition_fakes import Gpu

from agentserve.executor.partition.base import PartitionBusy
from agentserve.executor.partition.green_ctx import GreenCtxBackend
from agentserve.protocol.lanes import Lane


def make(sms: int = 132) -> tuple[Gpu, GreenCtxBackend]:
    gpu = Gpu(sms, (9, 0))
    return gpu, GreenCtxBackend(gpu.drv, gpu.cuda)


def test_streams_destroyed_before_contexts() -> None:
    gpu, backend = make()
    made_streams, made_ctxs = len(gpu.drv.live_streams), len(gpu.drv.live_contexts)
    backend.close()
    names = [name for name, _ in gpu.drv.log]
    destroys = [n for n in names if n in ("cuStreamDestroy", "cuGreenCtxDestroy")]
    assert destroys == ["cuStreamDestroy"] * made_streams + ["cuGreenCtxDestroy"] * made_ctxs
    synced = {arg for name, arg in gpu.drv.log if name == "cuStreamSynchronize"}
    destroyed = [arg for name, arg in gpu.drv.log if name == "cuStreamDestroy"]
    assert synced == set(destroyed), "every stream is synchronised before it is destroyed"
    assert not gpu.drv.live_streams and not gpu.drv.live_contexts and not gpu.violations
    backend.close()  # idempotent
    assert gpu.drv.calls["cuStreamDestroy"] == made_streams


def test_lane_binding_uses_its_rung_stream() -> None:
    gpu, backend = make()
    rung = backend.ladder[2]
    with backend.lane_context(Lane.DECODE, 2) as d:
        assert gpu.cuda.current() is d.stream and d.units == rung.decode_units
        with backend.lane_context(Lane.PREFILL, 2) as p:
            assert gpu.cuda.current() is p.stream and p.units == rung.prefill_units
            assert p.stream.handle.ctx is not d.stream.handle.ctx
            p_sms, d_sms = p.stream.handle.sms, d.stream.handle.sms
            assert len(p_sms | d_sms) == 132 and not p_sms & d_sms
    assert gpu.cuda.current() is None
    top = backend.ladder[-1].index
    with backend.lane_context(Lane.DECODE, top) as d:
        assert d.stream.kind == "plain" and d.stream.priority == -5 and d.units == 132
    backend.close()


def test_close_waits_for_bound_lane() -> None:
    gpu, backend = make()
    entered, leave = threading.Event(), threading.Event()

    def lane() -> None:
        with backend.lane_context(Lane.DECODE, 0):
            entered.set()
            leave.wait(5)

    t = threading.Thread(target=lane)
    t.start()
    entered.wait(5)
    with pytest.raises(PartitionBusy, match="lanes still bound"):
        backend.close(timeout=0.05)
    assert gpu.drv.calls["cuStreamDestroy"] == 0 and gpu.drv.calls["cuGreenCtxDestroy"] == 0
    closer = threading.Thread(target=backend.close, kwargs={"timeout": 5})
    closer.start()
    leave.set()
    t.join(5)
    closer.join(5)
    assert not gpu.drv.live_streams and not gpu.drv.live_contexts and not gpu.violations
    with pytest.raises(RuntimeError, match="closing or closed"), backend.lane_context(Lane.DECODE, 0):
        pass


@pytest.mark.parametrize("seed", range(5))
def test_close_under_lane_churn_never_destroys_a_stream_in_use(seed: int) -> None:
    """Two lanes rebind between random rungs while the main thread closes: no violation, ever."""
    gpu, backend = make(64)
    rng = random.Random(seed)
    stop = threading.Event()
    refused = []

    def lane(which: Lane, rs: random.Random) -> None:
        while not stop.is_set():
            try:
                with backend.lane_context(which, rs.randrange(len(backend.ladder))) as b:
                    assert gpu.cuda.current() is b.stream
                    time.sleep(0.001)  # hold the binding, so close() lands inside it
            except RuntimeError as e:
                refused.append(str(e))
                return

    threads = [threading.Thread(target=lane, args=(ln, random.Random(rng.random()))) for ln in Lane]
    for t in threads:
        t.start()
    threading.Event().wait(rng.uniform(0.0, 0.02))
    backend.close(timeout=5)
    stop.set()
    for t in threads:
        t.join(5)
    assert not gpu.violations
    assert not gpu.drv.live_streams and not gpu.drv.live_contexts
