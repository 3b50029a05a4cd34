"""The executor process: rings in, model steps on two lanes, results out.

Life cycle::

    attach rings ─▶ load model + KV cache ─▶ detect partitions ─▶ send Ready ─▶ serve ─▶ close
                         │ failure: ExecError(fatal) and exit 2

``serve`` reads the decision ring on the main thread and routes each message:

- ``Plan``     → the queue of its lane (decode or prefill); each lane is a thread bound to its
  partition share of the plan's rung for the duration of one step, so a rung change happens only
  at a step boundary.  Both lanes share one model and one KV cache.
- ``Release``  → drop the sequences' mirrored state (the orchestrator sends it only after all
  their results are back, see :mod:`agentserve.executor.sequences`).
- ``Shutdown`` → drain both lanes, close, exit 0.

Results of both lanes go back through the one result ring under a lock (the ring has one
producer process).  If the orchestrator dies, the ring raises ``PeerDied`` within a second and the
process exits, so it never keeps holding device memory.  SIGTERM / SIGINT stop it the same way.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from agentserve.executor.errors import EngineError
from agentserve.executor.partition.base import PartitionBackend
from agentserve.executor.partition.detect import detect
from agentserve.executor.runner import ModelRunner
from agentserve.executor.sequences import SequenceTable
from agentserve.executor.step import StepExecutor
from agentserve.shm.channel import RingPair
from agentserve.shm.errors import PeerDied, RingClosed
from agentserve.shm.messages import (
    WIRE_VERSION,
    ExecError,
    Lane,
    Plan,
    Ready,
    Reconfigure,
    Release,
    Result,
    Shutdown,
)

log = logging.getLogger("agentserve.executor")

RECV_POLL_S = 0.5


@dataclass
class ExecutorOptions:
    run: str
    model_dir: str
    role: str = "exec0"
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    max_model_len: int | None = None
    partition: str | None = None  # green-ctx | cuda-streams | cpu-cores | None = detect


class LaneLoop(threading.Thread):
    """One lane: runs its plans in order, each bound to the lane's share of the plan's rung."""

    def __init__(
        self, lane: Lane, backend: PartitionBackend, execute: Callable[[Plan], list], send: Callable
    ) -> None:
        super().__init__(name=f"lane-{lane.name.lower()}", daemon=True)
        self.lane, self.backend, self.execute, self.send = lane, backend, execute, send
        self.plans: queue.SimpleQueue[Plan | None] = queue.SimpleQueue()

    def run(self) -> None:
        last_end = time.monotonic()
        while (plan := self.plans.get()) is not None:
            t_start = time.monotonic()
            try:
                with self.backend.lane_context(self.lane, plan.rung):
                    seqs = self.execute(plan)
            except EngineError as e:
                log.warning("step %d on %s lane failed: %s", plan.step, self.lane.name, e)
                self.send(ExecError(str(e), plan.step, [s.seq_id for s in plan.seqs]))
                continue
            t_end = time.monotonic()
            gap_ms = (t_start - last_end) * 1e3
            last_end = t_end
            self.send(Result(plan.step, self.lane, plan.rung, seqs, t_start, t_end, gap_ms))

    def stop(self) -> None:
        self.plans.put(None)


class Executor:
    def __init__(self, pair: RingPair, runner: ModelRunner, backend: PartitionBackend) -> None:
        self.pair, self.runner, self.backend = pair, runner, backend
        self.table = SequenceTable(runner.device)
        self.step = StepExecutor(runner, self.table, runner.config.eos_token_ids)
        self._send_lock = threading.Lock()
        self.lanes = {lane: LaneLoop(lane, backend, self.step.run, self.send) for lane in Lane}

    def send(self, msg) -> None:
        with self._send_lock:
            self.pair.send(msg)

    def ready(self, model: str) -> Ready:
        r = self.runner
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
            device=f"{r.device} {self.backend.device} {str(r.dtype).removeprefix('torch.')}",
            model=model,
        )

    def serve(self, model: str) -> str:
        """Run until Shutdown or a dead peer; return why it stopped."""
        for lane in self.lanes.values():
            lane.start()
        self.send(self.ready(model))
        try:
            return self._dispatch()
        finally:
            for lane in self.lanes.values():
                lane.stop()
            for lane in self.lanes.values():
                lane.join(timeout=10)

    def _dispatch(self) -> str:
        while True:
            try:
                msg = self.pair.recv(timeout=RECV_POLL_S)
            except TimeoutError:
                continue
            if isinstance(msg, Plan):
                self.lanes[Lane(msg.lane)].plans.put(msg)
            elif isinstance(msg, Release):
                self.table.release(msg.seq_ids)
            elif isinstance(msg, Reconfigure):
                log.info("reconfigure %s (rungs are chosen per plan)", msg)
            elif isinstance(msg, Shutdown):
                return msg.reason or "shutdown requested"


def _raise_on_signal(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def run_executor(opts: ExecutorOptions) -> int:
    """The process body; returns the exit code."""
    signal.signal(signal.SIGTERM, _raise_on_signal)
    pair = RingPair.attach(opts.run, opts.role)
    backend: PartitionBackend | None = None
    try:
        runner = ModelRunner(
            opts.model_dir,
            dtype=opts.dtype,
            device=opts.device,
            block_size=opts.block_size,
            num_blocks=opts.num_blocks,
            kv_cache_bytes=opts.kv_cache_bytes,
            max_model_len=opts.max_model_len,
        )
        backend = detect(opts.partition)
        why = Executor(pair, runner, backend).serve(opts.model_dir)
        log.info("executor stopping: %s", why)
        return 0
    except (EngineError, ValueError) as e:
        log.error("executor failed: %s", e)
        _try_send(pair, ExecError(str(e), fatal=True))
        return 2
    except (PeerDied, RingClosed) as e:
        log.error("orchestrator gone: %s", e)
        return 1
    except KeyboardInterrupt as e:
        log.info("executor interrupted (%s)", e)
        return 0
    finally:
        if backend is not None:
            backend.close()
        pair.close()


def _try_send(pair: RingPair, msg: ExecError) -> None:
    try:
        pair.send(msg, timeout=1.0)
    except Exception as e:  # the peer may be gone; the log already says why we stop
        log.debug("could not report fatal error: %s", e)
