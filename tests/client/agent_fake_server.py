"""An in-test AgentServe server: the real Ingress and SessionTable in front of an echo "engine".

The engine echoes the bytes of the turn's last message (or its raw token ids) one token per
step, so every stream is predictable: text ``t`` produces token ids ``list(t.encode())`` and the
same text back.  A message starting with ``CALL `` makes the model "emit" a Qwen-style tool call
instead.  ``eos`` ends an echo unless the turn sets ``ignore_eos`` (then it cycles).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from agentserve.orchestrator.ingress import ClientGone, Ingress
from agentserve.orchestrator.limits import ClientRules
from agentserve.orchestrator.session_table import SessionTable
from agentserve.protocol.client_messages import (
    PROTOCOL_VERSION,
    Abort,
    CloseSession,
    ErrorCode,
    FinishReason,
    GetStats,
    OpenSession,
    ProtocolError,
    SessionClosed,
    SessionOpened,
    StatsReply,
    Timings,
    TokenEvent,
    ToolCallEvent,
    Turn,
    TurnDone,
    Usage,
    Welcome,
)
from agentserve.protocol.stats import (
    Latency,
    Server,
    SessionRow,
    SessionState,
    Snapshot,
    encode_snapshot,
)


def recording_sends(client: Any, sent: list[str]) -> Callable[..., None]:
    """A stand-in for a sync client's ``_send`` that notes each message's type in ``sent``, then sends it."""
    real = client._send

    def send(msg: Any, expect_reply: bool = True) -> None:
        sent.append(type(msg).__name__)
        real(msg, expect_reply)

    return send


def recording_sends_async(client: Any, sent: list[str]) -> Callable[..., Awaitable[None]]:
    """The same for an asyncio client's ``_send``."""
    real = client._send

    async def send(msg: Any, expect_reply: bool = True) -> None:
        sent.append(type(msg).__name__)
        await real(msg, expect_reply)

    return send


@dataclass
class Entry:
    session: int
    client: bytes
    name: str = ""
    turn_req: int = 0  # req of the running turn, 0 when idle
    turns: int = 0

    @property
    def running_req(self) -> int:
        return self.turn_req


@dataclass
class Gen:
    client: bytes
    req: int
    session: int
    plan: list[int]
    max_tokens: int
    cycle: bool
    prompt_tokens: int
    cached_tokens: int
    tool_call: dict | None
    t0: float = field(default_factory=time.monotonic)
    out: list[int] = field(default_factory=list)
    t_first: float = 0.0
    aborting: bool = False  # with lazy_abort: ends at the next step


class EchoServer:
    def __init__(self, endpoint: str, *, max_model_len: int = 4096, token_delay_s: float = 0.0,
                 lazy_abort: bool = False) -> None:
        """``lazy_abort``: an abort ends its turn at the next step, as the real server's does with a step in flight
        (a message read in the same poll still finds the turn running)."""
        info = Welcome(0, PROTOCOL_VERSION, "fake", "echo", max_model_len, "fake-run", os.getpid())
        self.ingress = Ingress(endpoint, info=info, rules=ClientRules(probe_interval_s=0.05, heartbeat_ms=200))
        self.endpoint = self.ingress.endpoint
        self.max_model_len = max_model_len
        self.token_delay_s = token_delay_s
        self.lazy_abort = lazy_abort
        self.table: SessionTable[Entry] = SessionTable()
        self.context: dict[int, int] = {}
        self.gens: dict[int, Gen] = {}
        self.gone: list[bytes] = []
        self.aborted: list[int] = []  # reqs of turns aborted for a gone client
        self.turn_requests: list[Turn] = []
        self._stop = threading.Event()
        self._shutdown = threading.Event()
        self._thread = threading.Thread(target=self._run, name="echo-server", daemon=True)

    def __enter__(self) -> EchoServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def shut_down(self) -> None:
        """As the real server's loop ends on a stop: every running turn ends with ``server_shutdown``, then nothing
        is answered while the socket stays open (the real one is closed only after the executor has stopped)."""
        self._shutdown.set()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._shutdown.is_set():
                    self._end_all_turns()
                    self._stop.wait(0.01)
                    continue
                for cid, msg in self.ingress.poll(0 if self.gens else 5):
                    self._dispatch(cid, msg)
                self._step()
                if self.gens and self.token_delay_s:
                    time.sleep(self.token_delay_s)
        finally:
            self.ingress.close()

    def _end_all_turns(self) -> None:
        for gen in self.gens.values():
            why = ProtocolError(ErrorCode.SERVER_SHUTDOWN, "the server is shutting down", gen.req, gen.session)
            self.ingress.send(gen.client, why.to_event())
        self.gens.clear()

    # ---- requests ----------------------------------------------------------------------------

    def _dispatch(self, cid: bytes, msg: object) -> None:
        try:
            self._handle(cid, msg)
        except ProtocolError as e:
            self.ingress.send(cid, e.to_event())

    def _handle(self, cid: bytes, msg: object) -> None:
        if isinstance(msg, ClientGone):
            self.gone.append(cid)
            for entry in self.table.of_client(cid):
                self.table.drop(entry)
                gen = self.gens.pop(entry.session, None)
                if gen is not None:
                    self.aborted.append(gen.req)
        elif isinstance(msg, OpenSession):
            entry = self.table.add(Entry(self.table.new_id(), cid, msg.options.name))
            self.context[entry.session] = len((msg.system or "").encode())
            self.ingress.send(cid, SessionOpened(msg.req, entry.session, self.context[entry.session]))
        elif isinstance(msg, Turn):
            self._start_turn(cid, msg)
        elif isinstance(msg, Abort):
            self.table.owned(cid, msg.session, msg.req)  # ownership check
            gen = self.gens.get(msg.session)
            if gen is not None and msg.turn in (0, gen.req):
                if self.lazy_abort:
                    gen.aborting = True
                else:
                    self._finish(self.gens.pop(msg.session), FinishReason.ABORT)
        elif isinstance(msg, CloseSession):
            entry = self.table.owned(cid, msg.session, msg.req)
            self.table.drop(entry)
            self.gens.pop(msg.session, None)
            self.ingress.send(cid, SessionClosed(msg.req, entry.session))
        elif isinstance(msg, GetStats):
            self.ingress.send(cid, StatsReply(msg.req, encode_snapshot(self.snapshot())))

    def _start_turn(self, cid: bytes, turn: Turn) -> None:
        self.turn_requests.append(turn)
        entry = self.table.idle(cid, turn.session, turn.req)
        entry.turn_req, entry.turns = turn.req, entry.turns + 1
        if turn.token_ids:
            new, plan = len(turn.token_ids), list(turn.token_ids)
        else:
            new = sum(len(m.content.encode()) for m in turn.messages)
            plan = list(turn.messages[-1].content.encode())
        cached = self.context[entry.session]
        if cached + new + turn.max_tokens > self.max_model_len:
            entry.turn_req = 0
            raise ProtocolError(
                ErrorCode.PROMPT_TOO_LONG,
                f"{cached + new} prompt + {turn.max_tokens} max tokens > {self.max_model_len}",
                turn.req,
                turn.session,
            )
        self.context[entry.session] += new
        call = None
        text = turn.messages[-1].content if turn.messages else ""
        if text.startswith("CALL "):
            call = {"name": "calc", "arguments": {"expr": text[5:]}}
            plan = list(f"<tool_call>{json.dumps(call)}</tool_call>".encode())
        self.gens[entry.session] = Gen(
            cid, turn.req, entry.session, plan, turn.max_tokens, turn.ignore_eos, new, cached, call
        )

    # ---- the echo engine ---------------------------------------------------------------------

    def _step(self) -> None:
        for sid, gen in list(self.gens.items()):
            n = len(gen.out)
            if gen.aborting:
                self._finish(self.gens.pop(sid), FinishReason.ABORT)
                continue
            if n >= len(gen.plan) and not gen.cycle:
                reason = FinishReason.TOOL_CALLS if gen.tool_call else FinishReason.STOP
                self._finish(self.gens.pop(sid), reason)
                continue
            tok = gen.plan[n % len(gen.plan)]
            gen.out.append(tok)
            gen.t_first = gen.t_first or time.monotonic()
            self.context[sid] = self.context.get(sid, 0) + 1
            ev = TokenEvent(gen.req, sid, [tok], chr(tok), time.monotonic(), time.time())
            self.ingress.send(gen.client, ev)
            if len(gen.out) >= gen.max_tokens:
                self._finish(self.gens.pop(sid), FinishReason.LENGTH)

    def _finish(self, gen: Gen, reason: FinishReason) -> None:
        now = time.monotonic()
        if gen.tool_call and reason is FinishReason.TOOL_CALLS:
            call_id = f"call_{gen.session}_{gen.req}"
            args = gen.tool_call["arguments"]
            self.ingress.send(gen.client, ToolCallEvent(gen.req, gen.session, call_id, "calc", args))
        entry = self.table.get(gen.session)
        if entry is not None:
            entry.turn_req = 0
        n = len(gen.out)
        ttft = (gen.t_first - gen.t0) * 1e3 if gen.t_first else 0.0
        tpot = ((now - gen.t_first) * 1e3 / (n - 1)) if n > 1 else 0.0
        usage = Usage(gen.prompt_tokens, gen.cached_tokens, n)
        timings = Timings(0.0, ttft, tpot, (now - gen.t0) * 1e3)
        self.ingress.send(gen.client, TurnDone(gen.req, gen.session, reason, usage, timings, now, time.time()))

    def snapshot(self) -> Snapshot:
        rows = [
            SessionRow(
                id=e.session,
                name=e.name,
                state=SessionState.DECODING if e.session in self.gens else SessionState.IDLE,
                turn=e.turns,
                context_tokens=self.context.get(e.session, 0),
            )
            for e in self.table.values()
        ]
        server = Server(pid=os.getpid(), endpoint=self.endpoint, run="fake-run", model="echo")
        return Snapshot(t_wall=time.time(), server=server, sessions=rows, tpot=Latency(slo_ms=50.0))
