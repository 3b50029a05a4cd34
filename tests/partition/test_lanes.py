"""LaneWorker: ordered steps on a bound thread, rebinding at step boundaries, cross-lane ordering."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from partition_fakes import Gpu

from agentserve.executor.lanes import LaneWorker, Marker, SeqReady
from agentserve.executor.partition.base import LaneBinding
from agentserve.executor.partition.cpu_cores import ONE_THREAD_MAX_TOKENS, CpuCoresBackend
from agentserve.executor.partition.green_ctx import GreenCtxBackend
from agentserve.protocol.lanes import Lane


@pytest.fixture
def cpu() -> CpuCoresBackend:
    backend = CpuCoresBackend()
    yield backend
    backend.close()


def thread_view(binding):
    return (
        threading.current_thread().name,
        tuple(sorted(os.sched_getaffinity(threading.get_native_id()))),
        torch.get_num_threads(),
        binding.rung.index,
    )


def test_steps_run_in_order_on_the_bound_lane_thread(cpu: CpuCoresBackend) -> None:
    seen: list[int] = []
    with LaneWorker(cpu, Lane.PREFILL, rung=0) as lane:
        steps = [lane.submit(lambda b, i=i: (seen.append(i), thread_view(b))[1]) for i in range(20)]
        views = [s.result(10) for s in steps]
    assert seen == list(range(20))
    rung = cpu.ladder[0]
    cores = cpu.cores_for(Lane.PREFILL, rung)
    assert set(views) == {("lane-prefill", cores, len(cores), 0)}
    assert [t.index for t in lane.timings] == list(range(20))
    assert all(t.gap_s >= 0 and t.end >= t.start for t in lane.timings)
    assert not cpu.in_use(), "the lane unbinds when it stops"


def test_rebind_happens_only_at_step_boundaries(cpu: CpuCoresBackend) -> None:
    started, release = threading.Event(), threading.Event()
    top = cpu.ladder[-1].index
    with LaneWorker(cpu, Lane.DECODE, rung=0) as lane:
        first = lane.submit(lambda b: (started.set(), release.wait(10), thread_view(b))[2])
        started.wait(10)
        lane.rebind(top)  # requested while the first step runs
        second = lane.submit(thread_view)
        third = lane.submit(thread_view, rung=0)
        release.set()
        views = [first.result(10), second.result(10), third.result(10)]
    assert [v[3] for v in views] == [0, top, 0]
    assert views[1][1] == cpu.cores and views[1][2] == len(cpu.cores)
    assert [t.rung for t in lane.timings] == [0, top, 0]


def test_two_lanes_use_their_own_thread_counts_at_once(cpu: CpuCoresBackend) -> None:
    """Decode on the shared top rung (all cores) while prefill is on rung 0: each sees its own count."""
    if len(cpu.cores) < 2:
        pytest.skip("needs two cores")
    barrier = threading.Barrier(2, timeout=10)

    def view_at_barrier(binding):
        barrier.wait()
        torch.randn(128, 128) @ torch.randn(128, 128)
        out = thread_view(binding)
        barrier.wait()
        return out

    top = cpu.ladder[-1].index
    with LaneWorker(cpu, Lane.DECODE, rung=top) as dec, LaneWorker(cpu, Lane.PREFILL, rung=0) as pre:
        d, p = dec.submit(view_at_barrier), pre.submit(view_at_barrier)
        dv, pv = d.result(10), p.result(10)
    assert dv[2] == len(cpu.cores) and pv[2] == len(cpu.cores_for(Lane.PREFILL, cpu.ladder[0]))
    assert dv[1] == cpu.cores and set(pv[1]).isdisjoint(cpu.cores_for(Lane.DECODE, cpu.ladder[0]))


def test_decode_waits_for_the_prefill_of_its_sequence(cpu: CpuCoresBackend) -> None:
    ready = SeqReady()
    kv: dict[int, str] = {}
    gate = threading.Event()
    with LaneWorker(cpu, Lane.DECODE) as dec, LaneWorker(cpu, Lane.PREFILL) as pre:
        pf = pre.submit(lambda b: (gate.wait(10), kv.__setitem__(7, "prefilled"))[1])
        ready.mark([7], pf.marker)
        dc = dec.submit(lambda b: kv.get(7), after=ready.pending([7, 8]))
        assert not dc.future.done()
        gate.set()
        assert dc.result(10) == "prefilled"
    assert dec.timings[0].wait_s >= 0
    assert ready.pending([7]) == [], "a completed host-only marker is nothing to wait for"
    ready.drop([7])


def test_failed_prefill_fails_the_dependent_decode(cpu: CpuCoresBackend) -> None:
    with LaneWorker(cpu, Lane.DECODE) as dec, LaneWorker(cpu, Lane.PREFILL) as pre:
        pf = pre.submit(lambda b: 1 / 0)
        dc = dec.submit(lambda b: "ran", after=[pf.marker])
        with pytest.raises(RuntimeError, match="awaited step failed"):
            dc.result(10)
        assert dec.submit(lambda b: "still alive").result(10) == "still alive"
    with pytest.raises(RuntimeError, match="is stopped"):
        dec.submit(lambda b: None)


def test_gpu_ordering_uses_stream_events_not_host_sync() -> None:
    gpu = Gpu(132, (9, 0))
    backend = GreenCtxBackend(gpu.drv, gpu.cuda)
    with LaneWorker(backend, Lane.DECODE, rung=1) as dec, LaneWorker(backend, Lane.PREFILL, rung=1) as pre:
        pf = pre.submit(lambda b: b.stream)
        dc = dec.submit(lambda b: b.stream, after=[pf.marker])
        prefill_stream, decode_stream = pf.result(10), dc.result(10)
    assert prefill_stream is not decode_stream
    assert prefill_stream.recorded == [pf.marker.cuda_event]
    assert decode_stream.waited == [pf.marker.cuda_event]
    assert pf.marker.cuda_event.synced == 0
    backend.close()
    assert not gpu.violations


def test_marker_timeout() -> None:
    with pytest.raises(TimeoutError):
        Marker().wait(timeout=0.01)


def test_one_thread_lane_spawns_no_intra_op_workers(cpu: CpuCoresBackend) -> None:
    """torch 2.13 (OpenMP + MKL): set_num_threads is per thread once torch's lazy per-thread init ran.

    With the process at 2+ threads, a lane bound to 1 core runs a GEMM and a parallel_for without
    creating any OS thread, so its intra-op count really is its own."""
    if len(cpu.cores) < 2:
        pytest.skip("needs two cores")
    torch.set_num_threads(len(cpu.cores))

    def tasks() -> int:
        return len(os.listdir("/proc/self/task"))

    def work(binding):
        before = tasks()
        a = torch.randn(512, 512)
        a @ a
        torch.randn(2_000_000).exp_()
        return binding.threads, torch.get_num_threads(), before, tasks()

    with LaneWorker(cpu, Lane.DECODE, rung=0) as lane:
        threads, seen, before, after = lane.submit(work).result(30)
    assert threads == seen == 1
    assert after == before


def test_without_the_core_loan_prefill_runs_at_idle_priority_only_on_the_shared_rung() -> None:
    def policy(binding):
        return os.sched_getscheduler(threading.get_native_id()), binding.idle

    cpu = CpuCoresBackend(lend_decode_cores=False)
    top = cpu.ladder[-1].index
    try:
        with LaneWorker(cpu, Lane.PREFILL, rung=top) as pre, LaneWorker(cpu, Lane.DECODE, rung=top) as dec:
            shared_prefill, shared_decode = pre.submit(policy).result(10), dec.submit(policy).result(10)
            own = pre.submit(policy, rung=0).result(10) if cpu.ladder[0].partitioned else None
    finally:
        cpu.close()
    assert shared_prefill == (os.SCHED_IDLE, True)
    assert shared_decode == (os.SCHED_OTHER, False)
    if own is not None:
        assert own == (os.SCHED_OTHER, False), "the policy is restored when the lane leaves the shared rung"


def test_with_the_core_loan_the_shared_rungs_prefill_keeps_normal_priority(cpu: CpuCoresBackend) -> None:
    """The loan hands decode its cores back between layers; an idle-priority prefill would also wait behind
    every other thread of the machine on its own core."""
    if cpu.loan is None:
        pytest.skip("needs two cores")
    top = cpu.ladder[-1].index
    with LaneWorker(cpu, Lane.PREFILL, rung=top) as pre:
        assert pre.submit(lambda b: (os.sched_getscheduler(0), b.idle)).result(10) == (os.SCHED_OTHER, False)
    assert "borrows decode's cores" in cpu.reason


def test_idle_priority_is_skipped_when_it_cannot_be_undone(monkeypatch: pytest.MonkeyPatch) -> None:
    from agentserve.executor.partition import cpu_cores

    monkeypatch.setattr(cpu_cores, "idle_is_reversible", lambda: "PermissionError: [Errno 1] Operation not permitted")
    backend = CpuCoresBackend(lend_decode_cores=False)
    assert not backend.idle_prefill_when_shared
    assert "keeps normal priority (SCHED_IDLE: PermissionError" in backend.reason
    top = backend.ladder[-1].index
    with LaneWorker(backend, Lane.PREFILL, rung=top) as pre:
        assert pre.submit(lambda b: (os.sched_getscheduler(0), b.idle)).result(10) == (os.SCHED_OTHER, False)
    backend.close()


def test_a_step_of_a_few_tokens_runs_on_one_intra_op_thread(cpu: CpuCoresBackend) -> None:
    """Decode of up to 4 sequences: one thread (no OpenMP barrier to stall); bigger steps: the binding's."""
    rung = cpu.ladder[-1]

    def threads_in_step(binding_threads: int, tokens: int) -> tuple[int, int]:
        out: list[int] = []

        def body() -> None:
            torch.get_num_threads()
            torch.set_num_threads(binding_threads)
            binding = LaneBinding(Lane.DECODE, rung, binding_threads, threads=binding_threads)
            with cpu.step_scope(binding, tokens):
                out.append(torch.get_num_threads())
            out.append(torch.get_num_threads())

        t = threading.Thread(target=body)
        t.start()
        t.join()
        return out[0], out[1]

    assert threads_in_step(2, ONE_THREAD_MAX_TOKENS) == (1, 2)
    assert threads_in_step(2, ONE_THREAD_MAX_TOKENS + 1) == (2, 2)
    assert threads_in_step(1, 1) == (1, 1)


def _layers(log: list[str], name: str, started: threading.Event, go: threading.Event, layers: int = 4):
    """A step that crosses ``layers`` layer boundaries (as a model's forward does), logging each."""
    from agentserve.executor.layer_hook import between_layers

    def step(binding: LaneBinding) -> str:
        for i in range(layers):
            between_layers()
            log.append(f"{name}{i}")
            if i == 0:
                started.set()
                go.wait(10)
        return name

    return step


def _preempt_a_chunk(lane: LaneWorker) -> list[str]:
    """A 4-layer chunk, a plain step queued behind it, and a preempting step sent while the chunk's first
    layer runs; returns the order in which their layers ran."""
    log: list[str] = []
    started, go, never = threading.Event(), threading.Event(), threading.Event()
    never.set()
    chunk = lane.submit(_layers(log, "chunk", started, go))
    queued = lane.submit(_layers(log, "queued", threading.Event(), never, layers=1))
    started.wait(10)
    resume = lane.submit(lambda b: log.append("resume") or "resume", preempt=True)
    go.set()
    assert [chunk.result(10), queued.result(10), resume.result(10)] == ["chunk", "queued", "resume"]
    return log


def test_a_preempting_step_runs_inside_the_running_one_at_its_next_layer(cpu: CpuCoresBackend) -> None:
    with LaneWorker(cpu, Lane.PREFILL, rung=0) as lane:
        log = _preempt_a_chunk(lane)
        inner, outer = lane.timings[0], lane.timings[1]  # a step's timing is kept when it ends
        assert outer.start <= inner.start and inner.end <= outer.end, "the resume's step ran inside the chunk's"
    assert log == ["chunk0", "resume", "chunk1", "chunk2", "chunk3", "queued0"]


def test_a_preempting_step_waits_for_its_markers_and_runs_alone_on_an_idle_lane(cpu: CpuCoresBackend) -> None:
    log: list[str] = []
    started, go, never = threading.Event(), threading.Event(), threading.Event()
    never.set()
    pending = Marker()
    with LaneWorker(cpu, Lane.PREFILL, rung=0) as lane:
        chunk = lane.submit(_layers(log, "chunk", started, go))
        started.wait(10)
        blocked = lane.submit(lambda b: log.append("blocked"), after=[pending], preempt=True)
        go.set()
        chunk.result(10)
        pending.complete()
        blocked.result(10)
        alone = lane.submit(_layers(log, "alone", threading.Event(), never, layers=1), preempt=True)
        assert alone.result(10) == "alone"
    assert log == ["chunk0", "chunk1", "chunk2", "chunk3", "blocked", "alone0"]


def test_on_a_gpu_a_preempting_step_runs_in_its_turn_not_inside() -> None:
    """A GPU's host queues a step's layers long before they run (and attention plans are per thread), so
    there a preempting step runs in its turn, as a plain step."""
    gpu = Gpu(132, (9, 0))
    backend = GreenCtxBackend(gpu.drv, gpu.cuda)
    with LaneWorker(backend, Lane.PREFILL, rung=1) as lane:
        log = _preempt_a_chunk(lane)
    backend.close()
    assert log == ["chunk0", "chunk1", "chunk2", "chunk3", "queued0", "resume"]
