"""The executor against GPU rules, on the CPU: every (rung, lane) warmed before Ready, a sticky CUDA
error ends the executor (the orchestrator restarts it), the device index reaches the partition backend."""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from agentserve.executor import process
from agentserve.executor.builtin import resolve_model
from agentserve.executor.lanes import LaneWorker
from agentserve.executor.process import Executor, ExecutorOptions
from agentserve.executor.runner import ModelRunner
from agentserve.protocol.lanes import Lane, Rung
from agentserve.protocol.ring_messages import ExecError, Plan, Ready, Result, SeqPlan, Shutdown
from agentserve.protocol.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "partition"))
from partition_fakes import Gpu  # noqa: E402

from agentserve.executor.partition.green_ctx import GreenCtxBackend  # noqa: E402


class FakePair:
    """The executor's ring pair: ``recv`` from a queue the test fills, ``send`` into a list."""

    def __init__(self) -> None:
        self.inbox: queue.Queue = queue.Queue()
        self.sent: list[object] = []
        self.got = threading.Condition()

    def recv(self, timeout: float | None = None) -> object:
        try:
            return self.inbox.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError from None

    def send(self, msg: object, timeout: float | None = None) -> None:
        with self.got:
            self.sent.append(msg)
            self.got.notify_all()

    def wait_for(self, kind: type, timeout: float = 30.0) -> object:
        with self.got:
            assert self.got.wait_for(lambda: any(isinstance(m, kind) for m in self.sent), timeout), self.sent
            return next(m for m in self.sent if isinstance(m, kind))

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(resolve_model("tiny"), dtype="float32", device="cpu", num_blocks=64)


def _plan(step: int, seq: int, lane: Lane = Lane.DECODE) -> Plan:
    sp = SeqPlan(seq, [11, 12, 13], 0, new_blocks=[seq * 4], sampling=SamplingParams(max_tokens=4))
    return Plan(step=step, lane=lane, rung=0, token_budget=3, seqs=[sp])


def test_every_rung_and_lane_is_warmed_before_ready(runner: ModelRunner, monkeypatch) -> None:
    gpu = Gpu(64, (9, 0))
    backend = GreenCtxBackend(gpu.drv, gpu.cuda)
    warmed: list[tuple[int, Lane, bool]] = []
    pair = FakePair()
    real = LaneWorker._step

    def spy(self, item, binding, last_end):
        warmed.append((binding.rung.index, binding.lane, any(isinstance(m, Ready) for m in pair.sent)))
        return real(self, item, binding, last_end)

    monkeypatch.setattr(LaneWorker, "_step", spy)
    ex = Executor(pair, runner, backend)
    pair.inbox.put(Shutdown("test"))
    assert ex.serve("tiny") == "test"
    before_ready = {(r, lane) for r, lane, ready in warmed if not ready}
    assert before_ready == {(r.index, lane) for r in backend.ladder for lane in Lane}
    backend.close()
    assert not gpu.violations


def test_cpu_lanes_are_not_warmed(runner: ModelRunner, monkeypatch) -> None:
    """CPU start-up stays as it was: no per-context kernels to load."""
    from agentserve.executor.partition.cpu_cores import CpuCoresBackend

    backend = CpuCoresBackend()
    calls: list[int] = []
    monkeypatch.setattr(runner, "warm_up", lambda: calls.append(1))
    pair = FakePair()
    pair.inbox.put(Shutdown("test"))
    Executor(pair, runner, backend).serve("tiny")
    assert calls == []
    backend.close()


def test_sticky_cuda_error_ends_the_executor(runner: ModelRunner, monkeypatch) -> None:
    from agentserve.executor.partition.cpu_cores import CpuCoresBackend

    backend = CpuCoresBackend()
    pair = FakePair()
    ex = Executor(pair, runner, backend)
    ran: list[int] = []

    def poisoned(plan, helper=None):
        ran.append(plan.step)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(ex.step, "run", poisoned)
    outcome: list[BaseException | str] = []

    def serve() -> None:
        try:
            outcome.append(ex.serve("tiny"))
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            outcome.append(e)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        pair.wait_for(Ready)
        pair.inbox.put(_plan(1, 0))
        err = pair.wait_for(ExecError)
        assert err.fatal and err.step == 1 and err.seq_ids == [0] and "illegal memory access" in err.message
        pair.inbox.put(_plan(2, 1))  # would run on a poisoned context
        t.join(5)
        assert not t.is_alive(), "the executor kept serving after a sticky CUDA error"
        assert ran == [1]
        assert isinstance(outcome[0], process.DeviceFault)
    finally:
        pair.inbox.put(Shutdown("test over"))
        t.join(10)
        backend.close()


def test_ordinary_step_errors_keep_the_executor_alive(runner: ModelRunner, monkeypatch) -> None:
    from agentserve.executor.partition.cpu_cores import CpuCoresBackend

    backend = CpuCoresBackend()
    pair = FakePair()
    ex = Executor(pair, runner, backend)
    real = ex.step.run
    monkeypatch.setattr(ex.step, "run", lambda plan, helper=None: (_ for _ in ()).throw(ValueError("bad plan"))
                        if plan.step == 1 else real(plan, helper))
    t = threading.Thread(target=ex.serve, args=("tiny",), daemon=True)
    t.start()
    try:
        pair.wait_for(Ready)
        pair.inbox.put(_plan(1, 0))
        assert not pair.wait_for(ExecError).fatal
        pair.inbox.put(_plan(2, 1))
        assert pair.wait_for(Result).step == 2
    finally:
        pair.inbox.put(Shutdown("done"))
        t.join(10)
        backend.close()
    assert not t.is_alive()


def test_run_executor_exits_nonzero_on_a_device_fault(monkeypatch) -> None:
    """The process ends (exit 3) instead of serving on; its death is what makes the orchestrator restart it."""
    import torch

    pair = FakePair()

    class Boom:
        def __init__(self, *a, **k) -> None:
            pass

        def serve(self, model: str) -> str:
            raise process.DeviceFault("sticky CUDA error: an illegal memory access was encountered")

    closed: list[bool] = []

    class Backend:
        def close(self, timeout: float = 10.0) -> None:
            closed.append(True)

    monkeypatch.setattr(process.RingPair, "attach", staticmethod(lambda run, role: pair))
    monkeypatch.setattr(process, "ModelRunner", lambda *a, **k: type("R", (), {"device": torch.device("cpu")})())
    monkeypatch.setattr(process, "detect", lambda *a, **k: Backend())
    monkeypatch.setattr(process, "Executor", Boom)
    assert process.run_executor(ExecutorOptions(run="r", model_dir="m")) == 3
    assert closed == [], "a poisoned context is not torn down: synchronising it would raise or hang"


@pytest.mark.parametrize(("device", "index"), [("cuda:1", 1), ("cuda:0", 0), ("cpu", 0)])
def test_device_index_reaches_the_partition_backend(device: str, index: int, monkeypatch) -> None:
    import torch

    seen: dict[str, object] = {}

    def fake_detect(prefer=None, **kw):
        seen.update(kw)
        raise process.EngineError("stop here")

    monkeypatch.setattr(process.RingPair, "attach", staticmethod(lambda run, role: FakePair()))
    monkeypatch.setattr(process, "ModelRunner", lambda *a, **k: type("R", (), {"device": torch.device(device)})())
    monkeypatch.setattr(process, "detect", fake_detect)
    assert process.run_executor(ExecutorOptions(run="r", model_dir="m", runner={"device": device})) == 2
    assert seen["cuda"].index == index


def test_sticky_error_while_warming_is_a_device_fault(runner: ModelRunner, monkeypatch) -> None:
    gpu = Gpu(64, (9, 0))
    backend = GreenCtxBackend(gpu.drv, gpu.cuda)
    ex = Executor(FakePair(), runner, backend)
    monkeypatch.setattr(runner, "warm_up", lambda: (_ for _ in ()).throw(
        RuntimeError("CUDA error: unspecified launch failure")))
    with pytest.raises(process.DeviceFault, match="warming rung 0"):
        ex.serve("tiny")
    backend.close()


def test_a_fault_before_ready_is_reported_once(monkeypatch) -> None:
    import torch

    pair = FakePair()

    class Boom:
        def __init__(self, *a, **k) -> None:
            pass

        def serve(self, model: str) -> str:
            raise process.DeviceFault("sticky CUDA error warming rung 0, DECODE: illegal memory access")

    monkeypatch.setattr(process.RingPair, "attach", staticmethod(lambda run, role: pair))
    monkeypatch.setattr(process, "ModelRunner", lambda *a, **k: type("R", (), {"device": torch.device("cpu")})())
    monkeypatch.setattr(process, "detect", lambda *a, **k: None)
    monkeypatch.setattr(process, "Executor", Boom)
    assert process.run_executor(ExecutorOptions(run="r", model_dir="m")) == 3
    errors = [m for m in pair.sent if isinstance(m, ExecError)]
    assert len(errors) == 1 and errors[0].fatal and "warming" in errors[0].message


CUBLAS_FAILURE = "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx( handle, ...)`"


@pytest.mark.parametrize("fails_on", ["green-ctx", "both"])
def test_a_failed_green_context_warm_up_falls_back_to_streams(runner: ModelRunner, monkeypatch, fails_on) -> None:
    """A non-sticky error warming a green context (on an H200: a small bf16 product on the prefill lane's
    context) starts the executor on plain streams, the reason saying why; a failure there too ends the start."""
    gpu, pair, made = Gpu(64, (9, 0)), FakePair(), []

    def fake_detect(prefer=None, **kw):
        made.append(GreenCtxBackend(gpu.drv, gpu.cuda))
        return made[-1]

    real_streams = process.CudaStreamsBackend

    def streams(cuda):
        made.append(real_streams(cuda))
        return made[-1]

    def warm_up() -> None:
        if made[-1].name == "green-ctx" and threading.current_thread().name.endswith("prefill") or fails_on == "both":
            raise RuntimeError(CUBLAS_FAILURE)

    monkeypatch.setattr(runner, "warm_up", warm_up)
    monkeypatch.setattr(process.RingPair, "attach", staticmethod(lambda run, role: pair))
    monkeypatch.setattr(process, "ModelRunner", lambda *a, **k: runner)
    monkeypatch.setattr(process, "detect", fake_detect)
    monkeypatch.setattr(process, "CudaStreamsBackend", streams)
    monkeypatch.setattr(process, "TorchCuda", lambda index=0: gpu.cuda)
    monkeypatch.setattr(process.signal, "signal", lambda *a: None)  # run_executor's SIGTERM handler
    pair.inbox.put(Shutdown("test over"))  # read once the executor serves
    code = process.run_executor(ExecutorOptions(run="r", model_dir="m"))
    assert [b.name for b in made] == ["green-ctx", "cuda-streams"]
    assert gpu.cuda.device_syncs == 1, "the device is idle before the green contexts go"
    if fails_on == "both":
        error = pair.wait_for(ExecError)
        assert code == 2 and not any(isinstance(m, Ready) for m in pair.sent)
        assert error.fatal and "CUBLAS_STATUS_EXECUTION_FAILED" in error.message and "warming rung 0" in error.message
        assert not error.message.startswith("executor crashed"), "a failed start is not a bug report"
    else:
        ready = pair.wait_for(Ready)
        assert code == 0 and ready.backend == "cuda-streams" and ready.ladder[0].partitioned is False
        assert "green-ctx failed its warm-up (warming rung 0, PREFILL: RuntimeError" in ready.reason
        assert "cuda-streams: two CUDA streams" in ready.reason
    assert all(b._closed for b in made) and not gpu.violations


def _fail_prefill_warm_up(monkeypatch, on: Callable[[Rung], bool]) -> None:
    """The warm-up's step fails as on the H200 on the prefill side of the rungs ``on`` picks."""
    real_warm = Executor._warm_step

    def warm_step(self, binding):
        if on(binding.rung) and binding.lane == Lane.PREFILL:
            raise RuntimeError(CUBLAS_FAILURE)
        return real_warm(self, binding)

    monkeypatch.setattr(Executor, "_warm_step", warm_step)


@pytest.mark.parametrize("bad", [{8}, {0}, {4}, {0, 3, 7}])
def test_a_rung_that_fails_its_warm_up_leaves_the_ladder(runner: ModelRunner, monkeypatch, bad: set[int]) -> None:
    """On an H200 small bf16 products failed only on one rung's 12-SM prefill side (rung 8 of 0-9): that rung leaves
    the ladder, the executor stays on green contexts, and every kept rung — the top one the lanes end their warm-up
    on included — still runs on its own streams under its new number."""
    gpu, pair = Gpu(132, (9, 0)), FakePair()
    backend = GreenCtxBackend(gpu.drv, gpu.cuda)
    before = list(backend.ladder)
    assert len(before) == 10 and max(bad) < len(before) - 1
    streams = {lane: {r.index: backend.stream_for(lane, r.index) for r in before} for lane in Lane}
    ran: list[object] = []
    _fail_prefill_warm_up(monkeypatch, lambda rung: rung.index in bad)
    ex = Executor(pair, runner, backend)
    t = threading.Thread(target=lambda: ran.append(ex.serve("tiny")), daemon=True)
    t.start()
    try:
        ready = pair.wait_for(Ready)
        assert ready.backend == "green-ctx"
        kept = [r for r in before if r.index not in bad]
        assert [r.index for r in ready.ladder] == list(range(len(kept)))
        sizes = [(r.decode_units, r.prefill_units) for r in ready.ladder]
        assert sizes == [(r.decode_units, r.prefill_units) for r in kept]
        dropped, _, rest = ready.reason.partition(" left out: their warm-up failed")
        assert dropped == "rungs " + ", ".join(f"{r.index} ({r.decode_units}/{r.prefill_units} SMs)"
                                               for r in before if r.index in bad)
        assert "CUBLAS" in rest
        assert [ex.lanes[lane].bound_rung for lane in Lane] == [len(kept) - 1] * 2, "bound to the new top's number"
        for new in range(len(kept)):
            for lane in Lane:
                bound = ex.lanes[lane].submit(lambda b: (b.rung, b.stream), rung=new).result(timeout=10)
                assert bound == (ready.ladder[new], streams[lane][kept[new].index])
    finally:
        pair.inbox.put(Shutdown("test over"))
        t.join(10)
        backend.close()
    assert not t.is_alive() and ran[-1] == "test over"
    assert not gpu.violations


def test_every_partitioned_rung_failing_its_warm_up_gives_up_green_contexts(runner: ModelRunner, monkeypatch) -> None:
    """Left with the top rung alone, green contexts partition nothing: the start fails its warm-up (and
    run_executor restarts the lanes on cuda-streams, above) instead of serving one unpartitioned rung."""
    gpu = Gpu(132, (9, 0))
    backend = GreenCtxBackend(gpu.drv, gpu.cuda)
    _fail_prefill_warm_up(monkeypatch, lambda rung: rung.partitioned)
    pair = FakePair()
    pair.inbox.put(Shutdown("served"))  # what an executor that kept the top rung alone would read, and return
    with pytest.raises(process.WarmUpFailed, match=r"warming rung 0, PREFILL: .*\(and on 8 more rungs\)"):
        Executor(pair, runner, backend).serve("tiny")
    assert not any(isinstance(m, Ready) for m in pair.sent)
    assert len(backend.ladder) == 10
    backend.close()
    assert not gpu.violations
