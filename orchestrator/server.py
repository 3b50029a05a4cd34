"""The orchestrator process loop: clients ⇄ ingress ⇄ scheduler ⇄ rings ⇄ executor.

One thread owns everything here.  Each turn of the loop::

    wait (zmq.Poller: the ingress socket and the executor link's wake-up pipe)
    ├─ client requests  → sessions, tokenisation, scheduler.submit / abort / close
    ├─ executor results → scheduler.on_result → SeqEvents → detokenised client events
    ├─ scheduler.schedule() → Plans / Releases onto the decision ring
    └─ every ``stats_interval_s``: a snapshot onto the stats board

Failure rules: bad client input gets a typed error and nothing else changes; if the executor
dies or hangs, every running turn gets ``Error(executor_failed)`` at once, then the executor is
restarted on fresh rings and a fresh scheduler (sessions keep their conversations and are
re-prefilled on their next turn) — or, with ``restart=False``, the loop ends with an error.
``stop()`` (SIGINT/SIGTERM) aborts running turns with ``Error(server_shutdown)`` and returns.

Last-resort guard: an unexpected exception while handling one client message or one turn's token
ends that turn (``Error(internal)``; the session is reset in the scheduler and keeps its
conversation), is logged with its context, and the loop goes on.  An exception from the scheduler
itself means a broken invariant: every turn gets ``Error(internal)`` and :meth:`Server.serve` raises
:class:`ServerBroken` after a clean stop.

Turns with more than ``tokenize_inline_bytes`` of text have their prompt built on the
:class:`~agentserve.orchestrator.prompt_worker.PromptWorker` thread, off the loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import msgspec
import zmq

from agentserve.orchestrator.constraints import constrained_sampling
from agentserve.orchestrator.conversation import Conversation
from agentserve.orchestrator.executor_link import (
    ExecutorDown,
    ExecutorLink,
    ExecutorStartError,
    Restarted,
    RestartFailed,
)
from agentserve.orchestrator.ingress import ClientGone, Ingress
from agentserve.orchestrator.limits import ServingLimits
from agentserve.orchestrator.prompt_worker import Done, PromptWorker
from agentserve.orchestrator.running_turn import RunningTurn
from agentserve.orchestrator.scheduler.config import SchedulerConfig
from agentserve.orchestrator.scheduler.events import SeqEvent
from agentserve.orchestrator.scheduler.scheduler import Scheduler
from agentserve.orchestrator.session_table import SessionTable
from agentserve.orchestrator.stats_publisher import StatsPublisher
from agentserve.orchestrator.step_trace import StepTrace
from agentserve.orchestrator.text.tokenization import Tokenizer
from agentserve.protocol.client_messages import (
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
    Turn,
    TurnDone,
)
from agentserve.protocol.limits import SESSION_LIMIT
from agentserve.protocol.ring_messages import ExecError, Plan, Ready, Result
from agentserve.protocol.sampling import Finish, SamplingError
from agentserve.shm.errors import MessageTooLarge

log = logging.getLogger("agentserve.orchestrator")


@dataclass
class SessionRecord:
    session: int
    client: bytes
    name: str
    conversation: Conversation
    parse_tools: bool = True
    turn: RunningTurn | None = None
    turns: int = 0
    scheduled: bool = False  # opened in the current scheduler
    last: RunningTurn | None = None  # the previous turn (for `top`)
    preparing: int = 0  # req of a turn whose prompt the worker thread is building
    opens: int = 0  # times opened in a scheduler: each gets its own id (a reset one may still be draining)

    @property
    def sched_id(self) -> str:
        """The session's id in the scheduler (a fresh one after each reset)."""
        return f"{self.session}.{self.opens}"

    @property
    def running_req(self) -> int:
        return self.turn.req if self.turn is not None else self.preparing


@dataclass
class ServerOptions:
    policy: str
    scheduler_config: SchedulerConfig
    restart: bool = True
    stats_interval_s: float = 0.1
    limits: ServingLimits = field(default_factory=ServingLimits)


@dataclass
class Server:
    ingress: Ingress
    link: ExecutorLink
    tokenizer: Tokenizer
    options: ServerOptions
    publisher: StatsPublisher
    clock: Callable[[], float] = time.monotonic
    sessions: SessionTable[SessionRecord] = field(default_factory=SessionTable)
    by_seq: dict[int, SessionRecord] = field(default_factory=dict)
    trace: StepTrace | None = None  # --trace-steps

    def __post_init__(self) -> None:
        self.sched = self._new_scheduler(self.link.ready)
        self.stop_token_ids = frozenset(self.link.ready.eos_token_ids) if self.link.ready else frozenset()
        self.vocab_size = self.link.ready.vocab_size if self.link.ready else 0
        self._running = True
        self._poller = zmq.Poller()
        self._poller.register(self.ingress.socket, zmq.POLLIN)
        self._poller.register(self.link.fileno(), zmq.POLLIN)
        self.worker = PromptWorker()
        self._poller.register(self.worker.fileno(), zmq.POLLIN)
        self._next_stats = 0.0
        self.restarting = False  # the executor is loading again after a crash

    def _new_scheduler(self, ready: Ready | None) -> Scheduler:
        assert ready is not None
        record = self.trace.record if self.trace is not None else None
        return Scheduler(self.options.policy, ready, self.options.scheduler_config, clock=self.clock, on_landed=record)

    # ---- the loop ----------------------------------------------------------------------------
    def stop(self) -> None:
        self._running = False

    def serve(self) -> None:
        """Run until :meth:`stop`; then abort what runs and return.  Raises :class:`ServerBroken` after
        ending every turn if the scheduler breaks an invariant."""
        try:
            while self._running:
                self.step(timeout_ms=self._wait_ms())
        except (ExecutorDownError, ExecutorStartError):
            raise
        except Exception as e:
            log.critical("internal error in the scheduler: the server stops", exc_info=True)
            self._end_all(ErrorCode.INTERNAL, f"internal server error ({type(e).__name__}: {e}); the server stops")
            raise ServerBroken(f"{type(e).__name__}: {e}") from e
        finally:
            self.worker.close()
        self._end_all(ErrorCode.SERVER_SHUTDOWN, "the server is shutting down")

    def _end_all(self, code: ErrorCode, why: str) -> None:
        for rec in self.sessions.values():
            if rec.turn is not None:
                self._fail_turn(rec, code, why)
            elif rec.preparing:
                self._fail_preparing(rec, code, why)

    def step(self, timeout_ms: int) -> None:
        ready = dict(self._poller.poll(timeout_ms))
        if self.link.fileno() in ready:
            self._on_executor(self.link.drain())
        if self.worker.fileno() in ready:
            for done in self.worker.drain():
                self._on_prepared(done)
        for client, msg in self.ingress.poll(0):
            self._on_client(client, msg)
        self._emit(self.sched.take_events())
        for msg in self.sched.schedule():  # while restarting: an empty scheduler, turns refused, nothing to send
            try:
                self.link.send(msg)
            except MessageTooLarge as e:
                if not isinstance(msg, Plan):
                    raise
                log.error("step %d cannot be sent: %s", msg.step, e)  # its turns fail; the server goes on
                self._emit(self.sched.on_error(ExecError(f"the step's plan is too large to send: {e}", step=msg.step)))
        self.link.check_hung()  # a hung executor is killed: its ExecutorDown arrives with the next drain
        now = self.clock()
        if now >= self._next_stats:
            self._next_stats = now + self.options.stats_interval_s
            self.publisher.publish(self, now)

    def _wait_ms(self) -> int:
        """Block until input when the scheduler has nothing to plan; otherwise just poll."""
        return 50 if self.sched.idle() else 5

    # ---- executor side ------------------------------------------------------------------------
    def _on_executor(self, msgs: list[object]) -> None:
        for msg in msgs:
            if isinstance(msg, Result):
                self.publisher.on_result(msg)
                self._emit(self.sched.on_result(msg))
            elif isinstance(msg, ExecError):
                log.warning("executor error at step %d: %s", msg.step, msg.message)
                self._emit(self.sched.on_error(msg))
            elif isinstance(msg, ExecutorDown):
                self._executor_down(msg.reason)
                return
            elif isinstance(msg, Restarted):
                self.sched = self._new_scheduler(msg.ready)  # the new executor's (its KV size may differ)
                self.restarting = False
                log.info("executor restarted: serving again")
            elif isinstance(msg, RestartFailed):
                self._running = False
                raise ExecutorStartError(f"the executor could not be restarted: {msg.reason}")

    def _executor_down(self, reason: str) -> None:
        log.error("%s", reason)
        for rec in self.sessions.values():
            if rec.turn is not None:
                self._fail_turn(rec, ErrorCode.EXECUTOR_FAILED, reason)
            rec.scheduled = False
        self.by_seq.clear()
        self.link.stop(timeout=2.0)
        if not self.options.restart:
            self._running = False
            raise ExecutorDownError(reason)
        log.info("restarting the executor")
        self.restarting = True  # turns are refused until Restarted; everything else is served
        self.sched = self._new_scheduler(self.link.ready)  # the last Ready; empty meanwhile: nothing is sent
        self.link.restart()

    def _emit(self, events: list[SeqEvent]) -> None:
        for ev in events:
            rec = self.by_seq.get(ev.seq_id)
            if rec is None or rec.turn is None or rec.turn.seq_id != ev.seq_id:
                continue
            try:
                self._emit_one(rec, rec.turn, ev)
            except Exception as e:  # noqa: BLE001 - the last-resort guard: this turn ends, the server goes on
                log.exception("unexpected error streaming turn %d of session %d", rec.turn.req, rec.session)
                self._reset_session(rec, f"internal error while streaming this turn ({type(e).__name__}: {e})")

    def _emit_one(self, rec: SessionRecord, turn: RunningTurn, ev: SeqEvent) -> None:
        if ev.token_id >= 0:
            out = turn.on_token(ev.token_id, ev.t, ev.logprob, ev.top_ids, ev.top_logprobs)
            if out is not None:
                self.ingress.send(rec.client, out)
            if turn.stopped_by_string and not ev.finished:
                self._emit(self.sched.abort(ev.seq_id))  # now, or when its step is back
                return
        if ev.finish is Finish.ERROR and not turn.stopped_by_string:  # a stop string completed it
            self._fail_step(rec)
        elif ev.finished:
            self._finish_turn(rec, ev.finish, ev.t)

    def _reset_session(self, rec: SessionRecord, why: str) -> None:
        """End the session's turn with ``internal`` and drop it from the scheduler (its KV is freed; the
        conversation stays, re-prefilled next turn)."""
        if rec.turn is not None:
            self._fail_turn(rec, ErrorCode.INTERNAL, why)
        elif rec.preparing:
            self._fail_preparing(rec, ErrorCode.INTERNAL, why)
        if rec.scheduled:
            rec.scheduled = False
            self._emit(self.sched.close_session(rec.sched_id))

    def _finish_turn(self, rec: SessionRecord, finish: Finish, t: float) -> None:
        turn = rec.turn
        assert turn is not None
        cached, served_t = self.sched.cached_tokens(turn.seq_id), self.sched.first_served(turn.seq_id)
        for event in turn.finish(finish, t, cached, served_t):
            self.ingress.send(rec.client, event)
        exact = not turn.stopped_by_string
        conv = rec.conversation
        conv.commit(bool(conv.raw), turn.prompt, turn.messages, turn.output_ids(), turn.raw_text(), exact)
        self.sched.end_turn(turn.seq_id, in_tool_call=turn.tool_calls_made)
        self.by_seq.pop(turn.seq_id, None)
        rec.last, rec.turn = turn, None
        self.publisher.on_turn_done(turn)

    def _fail_step(self, rec: SessionRecord) -> None:
        """A step of the turn failed (the executor lives on): the client gets ``executor_failed``, the
        conversation stays as before the turn, and the scheduler is told the turn ended."""
        seq_id = rec.turn.seq_id  # type: ignore[union-attr]
        why = f"the executor failed a step of this turn: {self.sched.failure(seq_id)}"
        self._fail_turn(rec, ErrorCode.EXECUTOR_FAILED, why)
        self.sched.end_turn(seq_id, in_tool_call=False)

    def _fail_turn(self, rec: SessionRecord, code: ErrorCode, message: str) -> None:
        turn = rec.turn
        assert turn is not None
        self.ingress.send(rec.client, ProtocolError(code, message, turn.req, rec.session).to_event())
        self.by_seq.pop(turn.seq_id, None)
        rec.turn = None

    def _fail_preparing(self, rec: SessionRecord, code: ErrorCode, message: str) -> None:
        """End a turn whose prompt is still being built (its late result is dropped)."""
        self.ingress.send(rec.client, ProtocolError(code, message, rec.preparing, rec.session).to_event())
        rec.preparing = 0

    # ---- client side --------------------------------------------------------------------------
    def _on_client(self, client: bytes, msg: object) -> None:
        try:
            if isinstance(msg, OpenSession):
                self._open(client, msg)
            elif isinstance(msg, Turn):
                self._turn(client, msg)
            elif isinstance(msg, Abort):
                self._abort(self.sessions.owned(client, msg.session, msg.req), msg.turn)
            elif isinstance(msg, CloseSession):
                self._close(self.sessions.owned(client, msg.session, msg.req))
                self.ingress.send(client, SessionClosed(msg.req, msg.session))
            elif isinstance(msg, GetStats):
                self.ingress.send(client, StatsReply(msg.req, self.publisher.encode(self, self.clock())))
            elif isinstance(msg, ClientGone):
                for rec in self.sessions.of_client(client):
                    self._close(rec)
        except ProtocolError as e:
            self.ingress.send(client, e.to_event())
        except Exception as e:  # noqa: BLE001 - the last-resort guard: this request fails, the server goes on
            self._contain(client, msg, e)

    def _contain(self, client: bytes, msg: object, exc: Exception) -> None:
        req, session = getattr(msg, "req", 0), getattr(msg, "session", 0)
        log.error("unexpected error handling %s (req %d, session %d) from client %s", type(msg).__name__, req,
                  session, client.hex(), exc_info=exc)
        why = f"internal error handling this request ({type(exc).__name__}: {exc})"
        rec = self.sessions.get(session) if session else None
        if rec is None or rec.client != client:
            self.ingress.send(client, ProtocolError(ErrorCode.INTERNAL, why, req, session).to_event())
            return
        answered = req != 0 and rec.running_req == req  # the turn this request started ends with the error
        self._reset_session(rec, why)
        if not answered:
            self.ingress.send(client, ProtocolError(ErrorCode.INTERNAL, why, req, session).to_event())

    def _open(self, client: bytes, msg: OpenSession) -> None:
        held, bound = self.sessions.count(client), self.options.limits.clients.max_sessions
        if held >= bound:
            why = f"this connection holds {held} open sessions, the limit of {bound} ({SESSION_LIMIT})"
            raise ProtocolError(ErrorCode.LIMIT_EXCEEDED, why, msg.req)
        conv = Conversation(self.tokenizer, system=msg.system, tools=list(msg.tools))
        rec = SessionRecord(self.sessions.new_id(), client, msg.options.name, conv, msg.options.parse_tool_calls)
        size = len(msg.system or "") + (len(msgspec.msgpack.encode(msg.tools)) if msg.tools else 0)
        if size > self.options.limits.clients.tokenize_inline_bytes:
            self._check_worker_room(client, size, msg.req)
            self.sessions.add(rec)  # announced when the worker has rendered it
            self.worker.submit(("open", rec.session, msg), conv.system_tokens, client, size)
            return
        self._opened(rec, msg, self._system_tokens(msg, conv.system_tokens))

    @staticmethod
    def _system_tokens(msg: OpenSession, job: Callable[[], list[int]]) -> list[int]:
        try:
            return job()
        except Exception as e:  # noqa: BLE001 - a template that cannot render these tools
            raise ProtocolError(ErrorCode.INVALID_REQUEST, f"cannot render the system prompt: {e}", msg.req) from None

    def _opened(self, rec: SessionRecord, msg: OpenSession, system_tokens: list[int]) -> None:
        self.sessions.add(rec)
        self.ingress.send(rec.client, SessionOpened(msg.req, rec.session, len(system_tokens)))

    def _turn(self, client: bytes, msg: Turn) -> None:
        rec = self.sessions.idle(client, msg.session, msg.req)
        self._check_turn(rec, msg)
        arrival = self.clock()
        size = rec.conversation.text_to_tokenize(msg)
        if size > self.options.limits.clients.tokenize_inline_bytes:
            self._check_worker_room(client, size, msg.req, rec.session)
            rec.preparing = msg.req
            job = partial(rec.conversation.prompt_for, msg)
            self.worker.submit(("turn", rec.session, msg, arrival), job, client, size)
            return
        self._start_turn(rec, msg, self._build(rec, msg, rec.conversation.prompt_for), arrival)

    def _check_worker_room(self, client: bytes, size: int, req: int, session: int = 0) -> None:
        """One connection's text waiting for the worker thread is bounded (a job alone always fits)."""
        held, bound = self.worker.held(client), self.options.limits.clients.max_tokenizing_bytes
        if held and held + size > bound:
            why = (f"this connection has {held} bytes waiting to be tokenised; {size} more exceed the limit of {bound} "
                   "(limits.clients.max_tokenizing_bytes): retry once its earlier requests have started")
            raise ProtocolError(ErrorCode.BUSY, why, req, session)

    def _check_turn(self, rec: SessionRecord, msg: Turn) -> None:
        if self.restarting:
            why = "the executor is restarting after a crash; retry shortly"
            raise ProtocolError(ErrorCode.EXECUTOR_FAILED, why, msg.req, rec.session)
        if msg.token_ids and max(msg.token_ids) >= self.vocab_size:
            raise ProtocolError(
                ErrorCode.INVALID_REQUEST,
                f"token id {max(msg.token_ids)} is outside the vocabulary [0, {self.vocab_size})",
                msg.req,
                rec.session,
                "prompt",
            )

    @staticmethod
    def _build(rec: SessionRecord, msg: Turn, job: Callable[[Turn], Any]) -> tuple[list[int], list[dict[str, Any]]]:
        """Run ``job`` (the conversation's prompt builder, or a finished worker result) with template
        errors turned into the client's typed error."""
        try:
            return job(msg)
        except ProtocolError:
            raise
        except ValueError as e:  # the chat template refused these messages (a raw turn's: its system prompt, tools)
            param = "" if msg.token_ids else "messages"
            raise ProtocolError(
                ErrorCode.INVALID_REQUEST, f"cannot render the conversation: {e}", msg.req, rec.session, param
            ) from None

    def _on_prepared(self, done: Done) -> None:
        """A prompt the worker built: start its turn (or open its session) unless it no longer matters."""
        kind, session, msg = done.key[:3]
        rec = self.sessions.get(session)
        if rec is None or (kind == "turn" and rec.preparing != msg.req):
            return  # closed, aborted or its client went away meanwhile
        try:
            if kind == "open":
                self._opened(rec, msg, self._system_tokens(msg, lambda: _result(done)))
                return
            rec.preparing = 0
            built = self._build(rec, msg, lambda _: _result(done))
            self._check_turn(rec, msg)  # the executor may have died meanwhile
            self._start_turn(rec, msg, built, done.key[3])
        except ProtocolError as e:
            if kind == "open":
                self.sessions.drop(rec)
            self.ingress.send(rec.client, e.to_event())
        except Exception as e:  # noqa: BLE001 - the last-resort guard
            self._contain(rec.client, msg, e)

    def _start_turn(
        self, rec: SessionRecord, msg: Turn, built: tuple[list[int], list[dict[str, Any]]], arrival: float
    ) -> None:
        prompt, messages = built
        max_len = self.sched.max_len
        if len(prompt) >= max_len:
            raise ProtocolError(
                ErrorCode.PROMPT_TOO_LONG,
                f"the conversation is {len(prompt)} tokens; this server's context holds {max_len - 1}",
                msg.req,
                rec.session,
                msg.input_param,  # OpenAI's context_length_exceeded names `messages`
            )
        sampling = constrained_sampling(msg, rec.conversation.tools, self.tokenizer, self.vocab_size)
        if not rec.scheduled:
            rec.opens += 1
            self.sched.open_session(rec.sched_id)
            rec.scheduled = True
        try:
            seq_id = self.sched.submit(rec.sched_id, prompt, sampling, full_prompt=True, now=arrival)
        except ValueError as e:
            param = e.param if isinstance(e, SamplingError) else ""
            raise ProtocolError(ErrorCode.INVALID_SAMPLING, str(e), msg.req, rec.session, param) from None
        turn = RunningTurn(
            msg.req,
            rec.session,
            seq_id,
            self.tokenizer,
            list(msg.stop),
            self.stop_token_ids,
            rec.parse_tools,
            arrival,
            prompt,
            messages,
            logprobs=msg.logprobs,
        )
        rec.conversation.raw = bool(msg.token_ids)
        rec.turn, rec.turns = turn, rec.turns + 1
        self.by_seq[seq_id] = rec

    def _abort(self, rec: SessionRecord, turn_req: int) -> None:
        if rec.preparing and turn_req in (0, rec.preparing):  # not scheduled yet: it ends here
            done = TurnDone(rec.preparing, rec.session, FinishReason.ABORT, t_mono=self.clock(), t_wall=time.time())
            rec.preparing = 0
            self.ingress.send(rec.client, done)
            return
        if rec.turn is None or (turn_req and turn_req != rec.turn.req):
            return  # nothing runs, or a late abort of a turn that already ended
        self._emit(self.sched.abort(rec.turn.seq_id))

    def _close(self, rec: SessionRecord) -> None:
        """Abort the session's running turn (its stream ends with ``aborted``), then drop the session."""
        why = f"session {rec.session} was closed during the turn"
        if rec.turn is not None:  # end the client's stream now; the scheduler's late events find no turn
            self._fail_turn(rec, ErrorCode.ABORTED, why)
        elif rec.preparing:
            self._fail_preparing(rec, ErrorCode.ABORTED, why)
        if rec.scheduled:  # a running turn is scheduled too: closing aborts it
            self._emit(self.sched.close_session(rec.sched_id))
        self.sessions.drop(rec)


def _result(done: Done) -> Any:
    if done.error is not None:
        raise done.error
    return done.result


class ExecutorDownError(RuntimeError):
    """The executor died and the server was told not to restart it."""


class ServerBroken(RuntimeError):
    """The scheduler broke an invariant; the server stopped after ending every turn."""
