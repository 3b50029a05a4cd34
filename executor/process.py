"""The executor process: rings in, model steps on two lanes, results out.

Life cycle::

    attach rings ─▶ load model + KV cache ─▶ detect partitions ─▶ warm (GPU) ─▶ send Ready ─▶ serve ─▶ close
                         │ failure: ExecError(fatal) and exit 2

``serve`` reads the decision ring on the main thread and routes each message:

- ``Plan``     → its lane's :class:`~agentserve.executor.lanes.LaneWorker` (decode or prefill): a
  thread bound to the lane's share of the plan's rung, rebound only between steps.  A plan waits
  for the other lane's step that last wrote one of its sequences (a CUDA event on a GPU), so a
  prefill completes before the first decode.  Both lanes share one model and one KV cache.
- ``Release``  → drop the sequences' mirrored state (the orchestrator sends it only after all
  their results are back, see :mod:`agentserve.executor.sequences`).
- ``Shutdown`` → drain both lanes, close, exit 0.

Results of both lanes go back through the one result ring under a lock (the ring has one
producer process).  If the orchestrator dies, the ring raises ``PeerDied`` within a second and the
process exits, so it never keeps holding device memory.  SIGTERM / SIGINT stop it the same way.

On CUDA the process picks one allocator pool for all lane streams before torch loads
(``__main__``, :mod:`agentserve.executor.memory`), binds the partitions to the device of ``--device cuda:N``, and
warms every (rung, lane) before ``Ready``.  A sticky CUDA error in a step (illegal address, device-side
assert: :mod:`agentserve.executor.faults`) poisons the context: the executor reports a fatal
``ExecError``, stops taking plans, and exits 3 without touching the device again; the orchestrator sees
it die and restarts it.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agentserve.executor.errors import EngineError
from agentserve.executor.faults import DeviceFault, WarmUpFailed, is_sticky_cuda_error
from agentserve.executor.fused.helper import DecodeHelper
from agentserve.executor.grammar import GrammarMasks
from agentserve.executor.lanes import LaneWorker, SeqReady
from agentserve.executor.memory import keep_lanes_independent, shared_pool_selected
from agentserve.executor.partition.base import BackendUnavailable, LaneBinding, PartitionBackend
from agentserve.executor.partition.cuda_streams import CudaStreamsBackend
from agentserve.executor.partition.detect import detect
from agentserve.executor.partition.green_ctx import structured_prefill
from agentserve.executor.partition.torch_cuda import TorchCuda, device_index
from agentserve.executor.runner import ModelRunner
from agentserve.executor.sequences import SequenceTable
from agentserve.executor.step import StepExecutor
from agentserve.executor.step_timing import timed_step
from agentserve.protocol.lanes import Lane
from agentserve.protocol.ring_messages import (
    WIRE_VERSION,
    ExecError,
    Plan,
    Ready,
    Reconfigure,
    Release,
    Result,
    Shutdown,
)
from agentserve.shm.channel import RingPair
from agentserve.shm.errors import PeerDied, RingClosed
from agentserve.shm.segment import PREFIX, cleanup_stale

if TYPE_CHECKING:
    import torch

log = logging.getLogger("agentserve.executor")

RECV_POLL_S = 0.5


# ModelRunner keyword arguments the executor's command line carries (name, type).
RUNNER_OPTIONS: tuple[tuple[str, type], ...] = (
    ("dtype", str),
    ("weights", str),
    ("kv_cache_dtype", str),
    ("attention_backend", str),
    ("device", str),
    ("block_size", int),
    ("num_blocks", int),
    ("kv_cache_bytes", int),
    ("max_model_len", int),
    ("cuda_graphs", str),
    ("decode_step", str),
    ("decode_helper", str),
    ("prefill_attention", str),
    ("memory_utilization", float),
    ("profile_tokens", int),
    ("cpu_kv_fraction", float),
    ("cpu_kv_cap_bytes", int),
)


@dataclass
class ExecutorOptions:
    run: str
    model_dir: str
    role: str = "exec0"
    partition: str | None = None  # green-ctx | cuda-streams | cpu-cores | None = detect
    runner: dict[str, Any] = field(default_factory=dict)  # ModelRunner keyword arguments (RUNNER_OPTIONS)
    allocator: str = "native"  # configure_cuda_allocator's choice, made by __main__ before torch loaded
    allocator_error: str = ""  # why AGENTSERVE_CUDA_ALLOCATOR was refused (reported once the rings are attached)


def device_description(where: str, device: torch.device) -> str:
    """The partition backend's description of its device ("cpu (2 cores)", "cuda:0 NVIDIA ..."), led by the
    runner's device where it does not already name it (the ready line said "cpu cpu (2 cores)")."""
    named = where.split(" ", 1)[0].split(":", 1)[0]  # "cpu", "cuda" (of "cuda:0 NVIDIA ...")
    return where if named == device.type else f"{device} {where}"


class Executor:
    def __init__(self, pair: RingPair, runner: ModelRunner, backend: PartitionBackend) -> None:
        self.pair, self.runner, self.backend = pair, runner, backend
        grammars = GrammarMasks(runner.model_dir / "tokenizer.json", runner.config.vocab_size,
                                runner.config.eos_token_ids)
        self.table = SequenceTable(runner.device, grammars)
        self.step = StepExecutor(runner, self.table, runner.config.eos_token_ids)
        self._send_lock = threading.Lock()
        top = len(backend.ladder) - 1
        self.lanes = {lane: LaneWorker(backend, lane, rung=top) for lane in Lane}
        self.decode_helper: DecodeHelper | None = None  # started with the lanes (serve)
        self.written = SeqReady()  # the step that last wrote each sequence's KV
        self._last_end = dict.fromkeys(Lane, time.monotonic())
        self.fault: BaseException | None = None  # the sticky CUDA error that ends this executor
        self._halt = threading.Event()
        self._fault_lock = threading.Lock()

    def submit(self, plan: Plan) -> None:
        """Queue ``plan`` on its lane, after any other-lane step that still writes its sequences."""
        ids = [s.seq_id for s in plan.seqs]
        lane = Lane(plan.lane)
        step = self.lanes[lane].submit(lambda b: self._run(plan, b), after=self.written.pending(ids), rung=plan.rung,
                                       preempt=plan.preempt)
        self.written.mark(ids, step.marker)
        step.future.add_done_callback(lambda f: self._report_failure(plan, f.exception()))

    def _run(self, plan: Plan, binding: LaneBinding) -> None:
        if self._halt.is_set():
            raise DeviceFault(f"not run: the executor is stopping after a device fault ({self.fault})")
        lane = Lane(plan.lane)
        t_start = time.monotonic()
        gap_ms = (t_start - self._last_end[lane]) * 1e3
        num_tokens = sum(max(1, len(s.token_ids)) for s in plan.seqs)
        label = f"{lane.name.lower()} rung {plan.rung} batch {len(plan.seqs)} tokens {num_tokens}"
        try:
            scope = self.backend.step_scope(binding, num_tokens, plan.hold_cores, plan.decode_idle)
            with scope as helper, timed_step(binding.stream, label) as clock:
                seqs = self.step.run(plan, helper)
        except Exception as e:  # noqa: BLE001 - a failed step is reported, the lane lives on
            self._last_end[lane] = time.monotonic()
            self._report_failure(plan, e)
            return
        t_end = self._last_end[lane] = time.monotonic()
        self.send(Result(plan.step, lane, plan.rung, seqs, t_start, t_end, gap_ms, clock.gpu_ms))

    def _report_failure(self, plan: Plan, error: BaseException | None) -> None:
        if error is None:
            return
        if is_sticky_cuda_error(error):
            self._on_fault(plan, error)
            return
        if self._halt.is_set():  # the orchestrator already heard the fatal error
            log.debug("step %d failed while stopping: %r", plan.step, error)
            return
        level = logging.WARNING if isinstance(error, EngineError) else logging.ERROR
        log.log(level, "step %d on the %s lane failed: %r", plan.step, Lane(plan.lane).name.lower(), error)
        self.send(ExecError(str(error) or repr(error), plan.step, [s.seq_id for s in plan.seqs]))

    def _on_fault(self, plan: Plan, error: BaseException) -> None:
        """The first sticky error: tell the orchestrator (fatal) and stop taking plans."""
        with self._fault_lock:
            first = self.fault is None
            if first:
                self.fault = error
                self._halt.set()
        if first:
            log.critical("step %d hit a sticky CUDA error, the executor exits: %r", plan.step, error)
            ids = [s.seq_id for s in plan.seqs]
            self.send(ExecError(f"device fault (the executor restarts): {error}", plan.step, ids, fatal=True))

    def warm(self) -> None:
        """On a GPU, one tiny step on every (rung, lane), one at a time, ending on the top rung.

        CUDA loads kernels per context on first launch, and each partitioned rung is its own pair of
        green contexts: without this the first step on each rung would pay for it.  CPU lanes have no
        per-rung state to load, and their start-up stays as it was.

        A sticky error is a :class:`DeviceFault`.  Any other failure on a partitioned rung drops that rung
        from the ladder (on an H200, small bf16 products failed only on the 12-SM prefill side of one rung);
        a failure on the top rung, or on every partitioned one, is :class:`WarmUpFailed`."""
        if self.backend.unit != "SMs":
            return
        failed: dict[int, str] = {}
        for rung in self.backend.ladder:
            for lane in Lane:
                try:
                    self.lanes[lane].submit(self._warm_step, rung=rung.index).result()
                except Exception as e:
                    if is_sticky_cuda_error(e):
                        raise DeviceFault(f"sticky CUDA error warming rung {rung.index}, {lane.name}: {e}") from e
                    failed.setdefault(rung.index, f"warming rung {rung.index}, {lane.name}: {type(e).__name__}: {e}")
        if failed:
            self._drop_failed_rungs(failed)

    def _drop_failed_rungs(self, failed: dict[int, str]) -> None:
        ladder = self.backend.ladder
        first = next(iter(failed.values()))
        if ladder[-1].index in failed or len(failed) == len(ladder) - 1:  # the fallback collects as below
            raise WarmUpFailed(first if len(failed) == 1 else f"{first} (and on {len(failed) - 1} more rungs)")
        # The failed steps' exceptions hold tensors made on the dropped rungs' streams in reference cycles (their
        # tracebacks reach the lane step's future): free them now, not in a collection after those streams are gone.
        gc.collect()
        described = ", ".join(f"{i} ({ladder[i].decode_units}/{ladder[i].prefill_units} SMs)" for i in failed)
        log.warning("rungs %s failed their warm-up and leave the ladder: %s", described, first)
        self.backend.drop_rungs(failed, f"rungs {described} left out: their warm-up failed ({first[:200]})")
        top = self.backend.ladder[-1].index
        for lane in Lane:  # each lane's binding names its old top rung: bind it again by the new number
            self.lanes[lane].submit(lambda binding: None, rung=top).result()

    def _warm_step(self, binding: LaneBinding) -> None:
        with self.backend.step_scope(binding, 4):
            self.runner.warm_up()
        if binding.stream is not None:
            binding.stream.synchronize()

    def send(self, msg) -> None:
        with self._send_lock:
            self.pair.send(msg)

    def ready(self, model: str) -> Ready:
        r = self.runner
        dtype = str(r.dtype).removeprefix("torch.")
        return Ready(
            wire_version=WIRE_VERSION,
            pid=os.getpid(),
            num_blocks=r.num_blocks,
            block_size=r.block_size,
            max_model_len=r.max_model_len,
            vocab_size=r.config.vocab_size,
            eos_token_ids=list(r.config.eos_token_ids),
            backend=self.backend.name,
            reason=self.backend.reason,
            ladder=list(self.backend.ladder),
            device=f"{device_description(self.backend.device, r.device)} {dtype}, {r.weight_format} matrices"
                   + (" (prefill's oneDNN-blocked)" if r.blocked_bytes else "")
                   + f", {str(r.kv_dtype).removeprefix('torch.')} KV"
                   + (", fused decode step" if r.fused_decode is not None else "")
                   + (f" with a helper on CPU(s) {list(self.decode_helper.cores)}" if self.decode_helper else "")
                   + (f", {r.prefill_attention} prefill attention" if r.prefill_attention else ""),
            model=model,
        )

    def serve(self, model: str) -> str:
        """Run until Shutdown or a dead peer; return why it stopped."""
        try:
            self._start_decode_helper()
            for lane in self.lanes.values():
                lane.start()
            self.warm()  # every (rung, lane) once, before graphs are captured on the warmed lanes
            self.capture_graphs()
            gc.collect()
            gc.freeze()  # the ~300k start-up objects (torch's modules) are never scanned again: ~3 % of a resume step
            self.send(self.ready(model))
            return self._dispatch()
        finally:
            for lane in self.lanes.values():
                lane.stop()
            if self.decode_helper is not None:
                log.info("decode helper: %s", self.decode_helper.counts())
                self.decode_helper.close()
            self.runner.drop_graphs()  # before the partitions they run on are closed

    def _start_decode_helper(self) -> None:
        helper = self.runner.new_decode_helper()
        if helper is not None and self.backend.attach_decode_helper(helper):
            self.decode_helper = helper
        elif helper is not None:
            helper.close()

    def capture_graphs(self) -> None:
        """Capture each rung's decode graphs on that rung's decode lane; on any failure decode stays eager."""
        why = self.runner.graphs_unavailable()
        if why is not None:
            log.info("decode graphs: none (%s)", why)
            return
        lane, rungs = self.lanes[Lane.DECODE], self.backend.ladder
        try:
            for i, rung in enumerate(rungs):
                log.info("decode graphs: capturing rung %d (%d of %d)", rung.index, i + 1, len(rungs))
                lane.submit(lambda b: self.runner.capture_graphs(b.rung.index, b.units), rung=rung.index).result()
        except Exception as e:  # noqa: BLE001 - graphs are an optimisation: serve eagerly instead
            log.warning("decode graphs: capture failed, decoding eagerly: %r", e)
            self.runner.drop_graphs()

    def _dispatch(self) -> str:
        while not self._halt.is_set():
            try:
                msg = self.pair.recv(timeout=RECV_POLL_S)
            except TimeoutError:
                continue
            if isinstance(msg, Plan):
                self.submit(msg)
            elif isinstance(msg, Release):
                self.table.release(msg.seq_ids)
                self.written.drop(msg.seq_ids)
            elif isinstance(msg, Reconfigure):
                log.info("reconfigure %s (rungs are chosen per plan)", msg)
            elif isinstance(msg, Shutdown):
                return msg.reason or "shutdown requested"
        fault = DeviceFault(f"sticky CUDA error: {self.fault}")
        fault.reported = True  # the fatal ExecError went out with the failed step
        raise fault from self.fault


def _raise_on_signal(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def runner_options(given: dict[str, Any]) -> dict[str, Any]:
    """``given`` with decode CUDA graphs off under the ``cudaMallocAsync`` pool, which cannot hold them
    (:mod:`agentserve.executor.memory`)."""
    if shared_pool_selected() and given.get("cuda_graphs", "auto") != "off":
        log.warning("decode CUDA graphs off: the cudaMallocAsync pool (AGENTSERVE_CUDA_ALLOCATOR=shared or "
                    "PYTORCH_CUDA_ALLOC_CONF) cannot hold Triton's graphs; decode runs eagerly")
        return {**given, "cuda_graphs": "off"}
    return given


def streams_after_failed_warm_up(backend: PartitionBackend, failure: str, cuda: TorchCuda) -> PartitionBackend:
    """Green contexts whose warm-up failed give way to plain streams (unpartitioned, said in the backend's
    reason: ``top`` and the log show it); any other backend's failure stands.

    Called outside the ``except`` that caught the failure, after a garbage collection: the failed step's frames
    held tensors made on a green context's stream, and under the ``cudaMallocAsync`` pool freeing them after
    that stream is destroyed aborts the process."""
    if backend.name != "green-ctx":
        raise WarmUpFailed(failure)
    log.warning("green contexts failed their warm-up (%s): falling back to cuda-streams, decode and prefill "
                "unpartitioned", failure)
    gc.collect()
    cuda.synchronize_device()
    backend.close()
    try:
        streams = CudaStreamsBackend(cuda)
    except BackendUnavailable as e:
        raise WarmUpFailed(f"{failure}; cuda-streams unavailable: {e}") from None
    streams.reason = f"green-ctx failed its warm-up ({failure}); cuda-streams: {streams.reason}"
    return streams


def run_executor(opts: ExecutorOptions) -> int:
    """The process body; returns the exit code."""
    signal.signal(signal.SIGTERM, _raise_on_signal)
    pair = RingPair.attach(opts.run, opts.role)
    backend: PartitionBackend | None = None
    try:
        if opts.allocator_error:
            raise EngineError(opts.allocator_error)
        runner = ModelRunner(opts.model_dir, **runner_options(opts.runner))
        index = device_index(runner.device)
        if runner.device.type == "cuda":
            log.info("allocator: %s (%s)", opts.allocator, keep_lanes_independent(index))
        structured_prefill()  # a typo there is an error here, not a silent fall-through to another backend
        backend = detect(opts.partition, cuda=TorchCuda(index))
        why = failure = ""
        try:
            why = Executor(pair, runner, backend).serve(opts.model_dir)
        except WarmUpFailed as e:
            failure = str(e)  # only the text leaves this block: the traceback's frames hold device tensors
        if failure:
            backend = streams_after_failed_warm_up(backend, failure, TorchCuda(index))
            why = Executor(pair, runner, backend).serve(opts.model_dir)
        log.info("executor stopping: %s", why)
        return 0
    except DeviceFault as e:  # the context is poisoned: no teardown call may touch the device again
        log.critical("executor exits after a device fault: %s", e)
        if not e.reported:
            _try_send(pair, ExecError(str(e), fatal=True))
        backend = None
        return 3
    except (EngineError, ValueError, WarmUpFailed) as e:
        log.error("executor failed: %s", e)
        _try_send(pair, ExecError(str(e), fatal=True))
        return 2
    except (PeerDied, RingClosed) as e:
        log.error("orchestrator gone: %s", e)
        _remove_leftovers(opts.run)
        return 1
    except KeyboardInterrupt as e:
        log.info("executor interrupted (%s)", e)
        return 0
    except Exception as e:  # anything else is a bug: say so to the orchestrator before going down
        log.exception("executor crashed")
        _try_send(pair, ExecError(f"executor crashed: {e!r}", fatal=True))
        return 2
    finally:
        if backend is not None:
            backend.close()
        pair.close()


def _remove_leftovers(run: str) -> None:
    """The segments and semaphores of ``run`` whose owner died: a SIGKILLed orchestrator left its rings and board
    behind, and only the executor that outlives it is there to remove them (those of a live one stay)."""
    try:
        cleanup_stale(f"{PREFIX}-{run}-")
    except Exception as e:  # noqa: BLE001 - best effort on the way out; `up` removes them at its next start
        log.warning("could not remove the dead orchestrator's shared memory: %r", e)


def _try_send(pair: RingPair, msg: ExecError) -> None:
    try:
        pair.send(msg, timeout=1.0)
    except Exception as e:  # the peer may be gone; the log already says why we stop
        log.debug("could not report fatal error: %s", e)
