"""The orchestrator's end of one executor process: spawn it, talk over the rings, notice its death.

The rings are the only channel.  A reader thread blocks on the result ring (the semaphore wait
releases the GIL) and hands each message to the orchestrator loop through a
:class:`~agentserve.orchestrator.wake_queue.WakeQueue`, which the loop's single ``zmq.Poller`` waits on
with the client socket.
If the executor dies, the reader's wait raises ``PeerDied`` within a second and the loop receives
an :class:`ExecutorDown` in the same queue.  If it hangs instead (plans in flight, no result within
the :class:`~agentserve.orchestrator.hang_watch.HangWatch` bound), :meth:`ExecutorLink.check_hung`
kills it, and the same ``ExecutorDown`` follows with the reason; so does :meth:`ExecutorLink.send` when the
decision ring stays full for that bound (the loop never blocks for good behind a stopped executor).

Each (re)start uses a fresh ring pair (``exec<N>``), so a restart never reads a half-written
message of the dead process.  :meth:`ExecutorLink.restart` loads the new executor on a thread and
reports :class:`Restarted` (or :class:`RestartFailed`) through the same queue, so the loop keeps
answering clients while the model loads.  Nothing here imports torch.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from agentserve.orchestrator.hang_watch import HangWatch
from agentserve.orchestrator.limits import HangRule
from agentserve.orchestrator.wake_queue import WakeQueue
from agentserve.protocol.lanes import OPENMP_BINDING_ENV, openmp_binding, openmp_wait_settings
from agentserve.protocol.ring_messages import WIRE_VERSION, ExecError, Plan, Ready, Result, Shutdown
from agentserve.shm.channel import RingPair
from agentserve.shm.errors import PeerDied, RingClosed, RingTimeout, ShmError

log = logging.getLogger("agentserve.orchestrator.executor")


class ExecutorStartError(RuntimeError):
    """The executor could not be started or failed before it was ready."""


@dataclass(frozen=True)
class Restarted:
    """Not a ring message: a :meth:`ExecutorLink.restart` finished; the new executor is ready."""

    ready: Ready


@dataclass(frozen=True)
class RestartFailed:
    """Not a ring message: a :meth:`ExecutorLink.restart` could not bring an executor up."""

    reason: str


@dataclass(frozen=True)
class ExecutorDown:
    """Not a ring message: the reader thread reports that the executor is gone."""

    reason: str


@dataclass
class ExecutorSpec:
    """How to start the executor process (arguments of ``python -m agentserve.executor``)."""

    run: str
    model_dir: str
    args: list[str] = field(default_factory=list)
    log_level: str = "INFO"
    log_json: bool = False

    def env(self) -> dict[str, str]:
        """The executor's environment: this process's, without OpenMP's binding settings (``OPENMP_BINDING_ENV``:
        they would pin the executor to one core before its partition backend reads the usable ones), and with a
        short spin of idle OpenMP workers unless it sets a wait policy (:func:`~.lanes.openmp_wait_settings`)."""
        env = {k: v for k, v in os.environ.items() if k not in OPENMP_BINDING_ENV}
        return env | openmp_wait_settings(os.environ)

    def command(self, role: str) -> list[str]:
        cmd = [sys.executable, "-m", "agentserve.executor", "--run", self.run, "--role", role]
        cmd += ["--model", self.model_dir, "--log-level", self.log_level, *self.args]
        return [*cmd, "--log-json"] if self.log_json else cmd


class ExecutorLink:
    def __init__(
        self, spec: ExecutorSpec, hang: HangRule | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.spec = spec
        self.watch = HangWatch(hang or HangRule())
        self._clock = clock
        self._hung_reason: str | None = None
        self.generation = -1
        self.pair: RingPair | None = None
        self.proc: subprocess.Popen | None = None
        self.ready: Ready | None = None
        self.inbox = WakeQueue()
        self._reader: threading.Thread | None = None
        self._starter: threading.Thread | None = None
        self._cancel = threading.Event()
        self._closing = threading.Event()
        self._heard = float("-inf")  # when the reader thread last received a message (drained or not)

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self, timeout: float | None = None, progress: Callable[[float], None] | None = None) -> Ready:
        """Spawn a fresh executor on fresh rings and wait for its ``Ready`` (at most ``timeout`` seconds, by
        default the rule's ``load_timeout_s``)."""
        ready = self._launch(self._load_timeout(timeout), progress)
        self._start_reader()
        return ready

    def _launch(self, timeout: float, progress: Callable[[float], None] | None) -> Ready:
        self.generation += 1
        self._hung_reason = None
        self.watch.reset(self._clock())
        role = f"exec{self.generation}"
        self.pair = RingPair.create(self.spec.run, role)
        # its own session: a Ctrl-C in the terminal reaches only the orchestrator, which stops it in order
        dropped = openmp_binding(os.environ)
        if dropped and self.generation == 0:
            log.info("the executor starts without %s: it pins its lane threads itself", ", ".join(dropped))
        self.proc = subprocess.Popen(self.spec.command(role), stdin=subprocess.DEVNULL, start_new_session=True,
                                     env=self.spec.env())
        self.pair.expect_peer(self.proc.pid)
        try:
            self.ready = self._await_ready(timeout, progress)
            if self.ready.wire_version != WIRE_VERSION:
                raise ExecutorStartError(f"executor speaks ring protocol {self.ready.wire_version}, not {WIRE_VERSION}")
        except BaseException:  # failed, cancelled or interrupted while loading: it would not read a Shutdown
            self.proc.kill()
            self.proc.wait()
            self.pair.close()  # a failed start leaves no rings behind, whatever follows it
            self.pair = None
            raise
        return self.ready

    def _load_timeout(self, timeout: float | None) -> float:
        return self.watch.rule.load_timeout_s if timeout is None else timeout

    def _start_reader(self) -> None:
        self._closing = threading.Event()  # set by stop(): a RingClosed after it is ours, not the executor's
        self._reader = threading.Thread(target=self._read, args=(self.pair, self.proc, self._closing),
                                        name="result-reader", daemon=True)
        self._reader.start()

    def restart(self, timeout: float | None = None) -> None:
        """:meth:`start` on a thread; its outcome arrives through :meth:`drain` as ``Restarted`` or
        ``RestartFailed``.  :meth:`stop` cancels a restart still loading."""
        self._starter = threading.Thread(target=self._restart, args=(self._load_timeout(timeout),),
                                         name="executor-restart", daemon=True)
        self._starter.start()

    def _restart(self, timeout: float) -> None:
        try:
            ready = self._launch(timeout, None)
        except Exception as e:  # noqa: BLE001 - whatever it was, the loop must hear that the restart failed
            self._post(RestartFailed(f"{type(e).__name__}: {e}" if not isinstance(e, ExecutorStartError) else str(e)))
            return
        self._post(Restarted(ready))  # before the reader can post an ExecutorDown of this executor
        self._start_reader()

    def _await_ready(self, timeout: float, progress: Callable[[float], None] | None) -> Ready:
        t0 = time.monotonic()
        assert self.pair is not None and self.proc is not None
        while time.monotonic() - t0 < timeout:
            if self._cancel.is_set():
                raise ExecutorStartError("start cancelled: the orchestrator is stopping")
            try:
                msg = self.pair.recv(timeout=0.25)
            except TimeoutError:
                if progress is not None:
                    progress(time.monotonic() - t0)
                continue
            except (PeerDied, RingClosed):
                code = self.proc.wait()
                raise ExecutorStartError(f"executor exited with code {code} before it was ready") from None
            if isinstance(msg, Ready):
                return msg
            if isinstance(msg, ExecError):
                self.proc.wait(timeout=10)
                raise ExecutorStartError(msg.message)
        raise ExecutorStartError(f"executor not ready after {timeout:g} s (limits.executor.load_timeout_s)")

    def stop(self, timeout: float = 10.0) -> int | None:
        """Ask the executor to shut down, wait, and release the rings; returns its exit code."""
        if self._starter is not None:  # a restart still loading gives up within one poll
            self._cancel.set()
            self._starter.join()
            self._starter = None
            self._cancel.clear()
        code = None
        self._closing.set()  # from here a closed ring is this stop's doing, not the executor's
        if self.proc is not None:
            if self.proc.poll() is None and self.pair is not None:
                try:
                    self.pair.send(Shutdown("orchestrator stopping"), timeout=1.0)
                except ShmError as e:
                    log.debug("could not send Shutdown: %s", e)
            code = self._reap(timeout)
        if self.pair is not None:
            self.pair.close()  # wakes the reader thread with RingClosed
        if self._reader is not None:
            self._reader.join(timeout=2.0)
        self.pair, self.proc, self._reader = None, None, None
        return code

    def _reap(self, timeout: float) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.warning("executor did not exit within %.0f s; killing it", timeout)
            self.proc.kill()
            return self.proc.wait()

    def close(self) -> None:
        self.stop()
        self.inbox.close()

    # ---- traffic ----------------------------------------------------------------------------
    def send(self, msg: msgspec.Struct) -> None:
        """Send ``msg``; if the executor is gone, drop it (the reader thread's ``ExecutorDown`` follows).

        A full decision ring is waited on for at most the hang bound: an executor that reads nothing for that
        long is killed as hung (the loop must not block for good behind a stopped executor).

        Raises ``MessageTooLarge`` for a message no ring slot holds (the executor is fine)."""
        if self._hung_reason is not None or self.pair is None:
            return  # killed as hung (its ExecutorDown is on the way), or a failed restart's (RestartFailed is)
        bound = self.watch.bound_s()
        try:
            self.pair.send(msg, timeout=bound)
        except RingTimeout:  # alive (or stopped) but not reading: the same rule as no results in flight
            self._kill_hung(f"executor hung: the decision ring stayed full for {bound:.1f} s")
            return
        except (PeerDied, RingClosed) as e:
            log.warning("could not send %s: %s", type(msg).__name__, e)
            return
        if isinstance(msg, Plan):
            self.watch.sent(msg.step, self._clock())

    def check_hung(self) -> str | None:
        """Kill the executor if it hangs (its ``ExecutorDown`` follows through :meth:`drain`); say why."""
        if self._hung_reason is not None or self.proc is None:
            return None
        now = self._clock()
        reason = self.watch.hung(now)  # first: runs every loop pass, costs no system call
        if reason is not None and now - self._heard <= self.watch.bound_s():
            return None  # results came in while the loop was busy elsewhere; they wait in the inbox
        if reason is not None:
            self._kill_hung(reason)
        return reason

    def _kill_hung(self, reason: str) -> None:
        if self.proc is not None and self.proc.poll() is None:
            log.error("%s; killing it (pid %d)", reason, self.proc.pid)
            self._hung_reason = reason
            self.proc.kill()

    def fileno(self) -> int:
        """Readable when :meth:`drain` has something (for ``zmq.Poller``)."""
        return self.inbox.fileno()

    def drain(self) -> list[object]:
        """Every message the reader thread has queued (results, errors, ExecutorDown)."""
        out = self.inbox.drain()
        for msg in out:
            if isinstance(msg, Result | ExecError):
                self.watch.landed(msg, self._clock())
        return out

    def _read(self, pair: RingPair, proc: subprocess.Popen[bytes] | None, closing: threading.Event) -> None:
        while True:
            try:
                msg: object = pair.recv()
                self._heard = self._clock()
            except PeerDied as e:
                msg = ExecutorDown(self._hung_reason or f"executor died: {e}")
            except RingClosed:
                why = f"executor closed its rings and {_exited(proc)}"  # at once when stop() has reaped it
                if closing.is_set():  # stop() closed them, or began while it exited: nobody waits for this one
                    return
                msg = ExecutorDown(self._hung_reason or why)
            except ShmError as e:
                msg = ExecutorDown(f"result ring failed: {e}")
            self._post(msg)
            if isinstance(msg, ExecutorDown):
                return

    def _post(self, msg: object) -> None:
        self.inbox.post(msg)


def _exited(proc: subprocess.Popen[bytes] | None, wait_s: float = 2.0) -> str:
    """How the executor ended, for the log: its exit code once it has exited, or that it has not."""
    if proc is None:
        return "was never started"
    try:
        code = proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        return f"has not exited after {wait_s:.0f} s"
    return f"exited with code {code}" if code >= 0 else f"was killed by signal {-code}"
