"""A server loop for tests: the real ZeroMQ ingress, scheduler, tokenizer and stats board, against a fake
executor link that answers every plan at once (or fails it on request)."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from simulation.fake_executor import ready

from agentserve.executor.builtin import resolve_model
from agentserve.orchestrator.executor_link import ExecutorLink, ExecutorSpec
from agentserve.orchestrator.ingress import Ingress
from agentserve.orchestrator.scheduler.config import SchedulerConfig
from agentserve.orchestrator.server import Server, ServerOptions
from agentserve.orchestrator.stats_publisher import StatsPublisher
from agentserve.orchestrator.step_trace import StepTrace
from agentserve.orchestrator.text.tokenization import Tokenizer
from agentserve.protocol.ring_messages import ExecError, Plan, Result, SeqResult

TOKEN = 65  # "A" in the byte-level vocabulary of the built-in models


class FakeLink(ExecutorLink):
    """An executor that samples ``TOKEN`` for every sequence a plan samples (``TOKEN + i`` for a sequence's
    i-th token with ``counting``); while ``failing``, or for a sequence's ``fail_from``-th token on, it
    fails the plan instead (a step error: the executor lives on).  No process: the link's own queue and
    wake-up pipe carry the replies."""

    def __init__(self) -> None:
        super().__init__(ExecutorSpec("fake", ""))
        self.ready = ready(256)
        self.failing = False
        self.tokenless = False  # results that sample no token (a broken executor)
        self.counting = False
        self.fail_from: int | None = None
        self.sampled: dict[int, int] = {}
        self.failed_steps: list[int] = []
        self.restarts = 0
        self.plans: list[Plan] = []

    def send(self, msg: object) -> None:
        if not isinstance(msg, Plan):
            return  # Release: nothing to free here
        self.plans.append(msg)
        sampled = [sp.seq_id for sp in msg.seqs if sp.sample]
        late = self.fail_from is not None and any(self.sampled.get(s, 0) + 1 >= self.fail_from for s in sampled)
        if self.failing or late:
            self.failed_steps.append(msg.step)
            reply: object = ExecError("injected failure", step=msg.step)
        else:
            for s in sampled:
                self.sampled[s] = self.sampled.get(s, 0) + 1
            t = time.monotonic()
            seqs = [SeqResult(s, -1 if self.tokenless else TOKEN + (self.sampled[s] - 1) * self.counting)
                    for s in sampled]
            reply = Result(msg.step, msg.lane, msg.rung, seqs, t, t)
        self._post(reply)

    def post(self, msg: object) -> None:
        """Deliver ``msg`` to the server as if the executor side had sent it."""
        self._post(msg)

    def restart(self, timeout: float = 600.0) -> None:
        self.restarts += 1  # the test posts Restarted (or RestartFailed) when it wants

    def stop(self, timeout: float = 10.0) -> int | None:
        return 0


def wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll ``cond`` (the server loop runs on another thread) until it holds; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def _serve(server: Server) -> None:
    try:
        server.serve()
    except Exception as e:  # noqa: BLE001 - a test reads it
        server.raised = e  # type: ignore[attr-defined]


@contextlib.contextmanager
def serving(
    tmp_path: Path, trace: StepTrace | None = None, options: ServerOptions | None = None
) -> Iterator[tuple[str, FakeLink, Server]]:
    """A served endpoint (its loop on a thread), the fake link and the server; stopped and cleaned up on exit."""
    run = f"t{uuid.uuid4().hex[:8]}"
    endpoint = f"ipc://{tmp_path}/ingress.sock"
    link = FakeLink()
    ingress = Ingress(endpoint)
    publisher = StatsPublisher(run, endpoint, "tiny", 50.0, 2000.0)
    tokenizer = Tokenizer.from_dir(resolve_model("tiny"))
    options = options or ServerOptions("agentserve", SchedulerConfig())
    server = Server(ingress, link, tokenizer, options, publisher, trace=trace)  # type: ignore[arg-type]
    loop = threading.Thread(target=_serve, args=(server,), name="server-loop")
    loop.start()
    try:
        yield endpoint, link, server
    finally:
        server.stop()
        loop.join(10)
        ingress.close()
        publisher.close()
        link.close()
        if trace is not None:
            trace.close()
