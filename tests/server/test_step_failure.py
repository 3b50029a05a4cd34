"""A failed executor step reaches the client as ``executor_failed`` — not as an abort it never asked for —
and the session goes on: the scheduler hears that the turn ended and the next turn is served.

The server loop runs for real (ZeroMQ ingress, scheduler, tokenizer, stats board) against a fake
executor link that answers every plan at once, or fails it on request.
"""

from __future__ import annotations

import os
import threading
import time
import uuid

import pytest

from agentserve.client import AgentClient
from agentserve.client.errors import ExecutorFailed
from agentserve.executor.builtin import resolve_model
from agentserve.orchestrator.config import SchedulerConfig
from agentserve.orchestrator.ingress import Ingress
from agentserve.orchestrator.server import Server, ServerOptions
from agentserve.orchestrator.sim_executor import ready
from agentserve.orchestrator.stats_publisher import StatsPublisher
from agentserve.orchestrator.tokenization import Tokenizer
from agentserve.shm.messages import ExecError, Plan, Result, SeqResult

TOKEN = 65  # "A" in the byte-level vocabulary of the built-in models


class FakeLink:
    """An executor that samples ``TOKEN`` for every sequence a plan samples (``TOKEN + i`` for a sequence's
    i-th token with ``counting``); while ``failing``, or for a sequence's ``fail_from``-th token on, it
    fails the plan instead (a step error: the executor lives on)."""

    def __init__(self) -> None:
        self.ready = ready(256)
        self.failing = False
        self.counting = False
        self.fail_from: int | None = None
        self.sampled: dict[int, int] = {}
        self.failed_steps: list[int] = []
        self._inbox: list[object] = []
        self._lock = threading.Lock()
        self._r, self._w = os.pipe()

    def fileno(self) -> int:
        return self._r

    def send(self, msg: object) -> None:
        if not isinstance(msg, Plan):
            return  # Release: nothing to free here
        sampled = [sp.seq_id for sp in msg.seqs if sp.sample]
        late = self.fail_from is not None and any(self.sampled.get(s, 0) + 1 >= self.fail_from for s in sampled)
        if self.failing or late:
            self.failed_steps.append(msg.step)
            reply: object = ExecError("injected failure", step=msg.step)
        else:
            for s in sampled:
                self.sampled[s] = self.sampled.get(s, 0) + 1
            t = time.monotonic()
            seqs = [SeqResult(s, TOKEN + (self.sampled[s] - 1) * self.counting) for s in sampled]
            reply = Result(msg.step, msg.lane, msg.rung, seqs, t, t)
        with self._lock:
            self._inbox.append(reply)
        os.write(self._w, b"x")

    def drain(self) -> list[object]:
        os.read(self._r, 4096)
        with self._lock:
            out, self._inbox = self._inbox, []
        return out

    def stop(self, timeout: float = 10.0) -> int | None:
        return 0

    def close(self) -> None:
        os.close(self._r)
        os.close(self._w)


@pytest.fixture()
def served(tmp_path):
    run = f"t{uuid.uuid4().hex[:8]}"
    endpoint = f"ipc://{tmp_path}/ingress.sock"
    link = FakeLink()
    ingress = Ingress(endpoint)
    publisher = StatsPublisher(run, endpoint, "tiny", 50.0, 2000.0)
    tokenizer = Tokenizer.from_dir(resolve_model("tiny"))
    server = Server(ingress, link, tokenizer, ServerOptions("agentserve", SchedulerConfig()), publisher)  # type: ignore[arg-type]
    loop = threading.Thread(target=server.serve, name="server-loop")
    loop.start()
    try:
        yield endpoint, link, server
    finally:
        server.stop()
        loop.join(10)
        ingress.close()
        publisher.close()
        link.close()


def test_a_failed_step_ends_the_turn_with_executor_failed_and_the_session_goes_on(served) -> None:
    endpoint, link, server = served
    with AgentClient(endpoint) as client, client.session(system="sys") as s:
        first = s.turn("hello", max_tokens=3, ignore_eos=True).collect()
        assert first.token_ids == [TOKEN] * 3
        link.failing = True
        with pytest.raises(ExecutorFailed, match="injected failure"):
            s.turn("this one fails", max_tokens=3, ignore_eos=True).collect()
        link.failing = False
        again = s.turn("and this one works", max_tokens=2, ignore_eos=True).collect()
        assert again.token_ids == [TOKEN] * 2 and again.done is not None
    assert link.failed_steps, "the failing turn reached the executor"
    assert server.sched.counters["failed"] == 1 and server.sched.counters["aborted"] == 0
    assert not server.sched.ended, "the scheduler was told the failed turn ended"


def test_a_turn_a_stop_string_completed_ends_normally_though_a_step_queued_behind_fails(served) -> None:
    """Tokens A, B, C, ...; the stop string "B" completes the turn at its 2nd token while the decode plan
    queued behind (it would sample the 3rd) fails: the turn's text is whole, so it ends with TurnDone."""
    endpoint, link, server = served
    link.counting, link.fail_from = True, 3
    with AgentClient(endpoint) as client, client.session(system="sys") as s:
        got = s.turn("spell", max_tokens=8, ignore_eos=True, stop=["B"]).collect()
        assert got.text == "A" and got.done is not None and got.done.finish == "stop"
    assert link.failed_steps, "the plan queued behind the stop was sent and failed"
