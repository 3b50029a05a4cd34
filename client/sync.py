"""The blocking client: ``AgentClient`` → ``Session`` → ``TurnStream`` (iterate for events).

One ``AgentClient`` per thread (a ZeroMQ socket is not thread-safe).  Many sessions and turns
may be open at once on one client: events are routed by request id, and those of a turn not
being read yet wait in its inbox.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Unpack

import zmq

from agentserve.client.errors import AgentServeError
from agentserve.client.events import TurnCore, TurnEvent, TurnResult
from agentserve.client.requests import MessageLike, TurnOptions, open_request
from agentserve.client.transport import ClientBase, SessionBase, connect
from agentserve.protocol.client_messages import (
    Abort,
    GetStats,
    SessionClosed,
    SessionOpened,
    StatsReply,
    Welcome,
)


class AgentClient(ClientBase):
    """A connection to an AgentServe server.

    ``timeout``: seconds to wait for a connection and for the answer to a request (handshake,
    open, close).  ``event_timeout``: the longest silence tolerated inside a turn's stream.
    A dead server raises :class:`ServerUnavailable` / :class:`ServerDisconnected`, never hangs.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout: float = 10.0,
        event_timeout: float = 300.0,
        heartbeat_ms: int = 1000,
        name: str = "",
    ) -> None:
        super().__init__(zmq.Context(), endpoint, timeout, event_timeout, heartbeat_ms)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._mon, zmq.POLLIN)
        self._inbox: dict[int, deque[Any]] = {}
        try:
            connect(self._sock, self.endpoint)
            self.server: Welcome = self._call(self._hello(name), Welcome)
        except BaseException:
            self.close()
            raise

    # ---- transport ---------------------------------------------------------------------------

    def _drain_monitor(self) -> None:
        while self._mon.poll(0):
            self._link.on_monitor(self._mon.recv_multipart())

    def _send(self, msg: Any, expect_reply: bool = True) -> None:
        self._drain_monitor()
        if expect_reply:
            self._link.check_answering(msg.req)
        if not self._sock.poll(int(self.timeout * 1000), zmq.POLLOUT):
            raise self._link.unavailable(self.timeout)
        self._drain_monitor()
        self._sock.send(self._link.encode(msg), zmq.NOBLOCK)
        if expect_reply:
            self._sent_epoch[msg.req] = self._link.epoch
            self._inbox[msg.req] = deque()

    def _send_nowait(self, msg: Any) -> None:
        """Send ``msg`` if the socket takes it now, expecting no reply; never raises (best effort)."""
        with contextlib.suppress(Exception):
            self._sock.send(self._link.encode(msg), zmq.NOBLOCK)

    def _drain_socket(self) -> None:
        while True:
            try:
                payload = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = self._link.decode(payload)
            if event is None:
                continue
            if event.req in self._inbox:
                self._inbox[event.req].append(event)
            else:
                self._unclaimed(event)

    def _recv(self, req: int, timeout: float) -> Any:
        """The next event for ``req``; raises on timeout or when the connection dropped."""
        deadline = time.monotonic() + timeout
        inbox = self._inbox[req]
        while not inbox:
            self._link.check_epoch(self._sent_epoch[req], req)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._link.silent(timeout, req)
            ready = dict(self._poller.poll(int(min(remaining, 1.0) * 1000) + 1))
            if self._sock in ready:
                self._drain_socket()
            if self._mon in ready and not inbox:
                self._drain_monitor()
        return inbox.popleft()

    def _forget(self, req: int) -> list[Any]:
        """Stop routing events to ``req``; returns those that came for it unread."""
        self._sent_epoch.pop(req, None)
        return list(self._inbox.pop(req, ()))

    def _call(self, msg: Any, expect: type) -> Any:
        self._send(msg)
        try:
            event = self._recv(msg.req, self.timeout)
        except BaseException:
            self._give_up(msg, self._forget(msg.req))
            raise
        self._forget(msg.req)
        return self._expect(event, expect, msg.req)

    # ---- API ---------------------------------------------------------------------------------

    def session(
        self,
        system: str | None = None,
        tools: Iterable[dict[str, Any]] | None = None,
        *,
        name: str = "",
        parse_tool_calls: bool = True,
    ) -> Session:
        """Open a session: a conversation whose KV the server keeps between turns.

        ``system`` is its system prompt: None sends no system message (the chat template's default, if it has one,
        applies), ``""`` an empty one.

        Given up before its ``SessionOpened`` came (Ctrl-C, a timeout), the session is closed once that comes:
        there is no background reader, so when this client next reads (any later request or turn).
        """
        opened = self._call(open_request(self._next_req(), system, tools, name, parse_tool_calls), SessionOpened)
        return Session(self, opened)

    def stats(self) -> bytes:
        """The server's latest stats snapshot (``agentserve.protocol.stats.decode_snapshot`` reads it)."""
        return self._call(GetStats(self._next_req()), StatsReply).snapshot

    def close(self) -> None:
        self._close_sockets()

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Session(SessionBase):
    """One agent conversation.  ``turn`` starts a turn; iterate the returned stream for events."""

    client: AgentClient

    def __init__(self, client: AgentClient, opened: SessionOpened) -> None:
        super().__init__(client, opened)
        self._active: TurnStream | None = None

    def turn(self, messages: str | Iterable[MessageLike] | None = None, **options: Unpack[TurnOptions]) -> TurnStream:
        """Start a turn: queued tool results, then ``messages`` (a str is a user message).

        Raw-token mode: ``turn(token_ids=[...], ignore_eos=True, max_tokens=N)``.  An unfinished
        previous turn of this session is aborted first.
        """
        if self._active is not None:
            self._active.close()
        req = self.client._next_req()
        request = self._state.new_turn(req, messages, **options)
        restore = self._state.carry(request)  # sent now: the queued tool results go with it
        try:
            self.client._send(request)
        except BaseException:
            restore()
            raise
        self._active = TurnStream(self, req, restore)
        return self._active

    def close(self) -> None:
        if self._state.closed:
            return
        self.client._drain_monitor()
        if self._active is not None:
            self._active.close()  # after a drop: ended at once, nothing sent
        if self._closed_with_connection():
            return
        self.client._call(self._close_request(), SessionClosed)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        try:
            self.close()
        except AgentServeError:
            if exc_type is None:
                raise


class TurnStream(TurnCore):
    """The events of one turn.  Iterate it, or ``collect()`` them into a :class:`TurnResult`."""

    def __init__(self, session: Session, req: int, on_error: Callable[[], None] | None = None) -> None:
        super().__init__(req, on_error)
        self.session = session

    def __iter__(self) -> Iterator[TurnEvent]:
        client = self.session.client
        while not self.finished:
            try:
                try:
                    wire_event = client._recv(self.req, client.event_timeout)
                except BaseException:  # a timeout, a lost server, Ctrl-C, a cancelled task: it may still run there
                    client._send_nowait(Abort(client._next_req(), self.session.id, self.req))
                    self.given_up = True
                    raise
                events = self.accept(wire_event)
            except BaseException:
                self.finished = True
                raise
            finally:
                if self.finished and not self.given_up:
                    client._forget(self.req)
            yield from events

    def collect(self) -> TurnResult:
        for _ in self:
            pass
        return self.result

    def abort(self) -> None:
        """Ask the server to stop this turn; the stream then ends with ``Done(finish=abort)``."""
        if not self.finished:
            client = self.session.client
            client._send(Abort(client._next_req(), self.session.id, self.req), expect_reply=False)

    def close(self) -> None:
        """Abort if still running and drain the stream (errors while draining are dropped).  After its connection
        dropped there is nothing to abort (the server ended the turn with it): it returns at once.  A stream given up
        waits (up to ``timeout``) for the server to end the turn it aborted."""
        if self.given_up:
            self._settle()
            return
        if self.finished:
            return
        self.session.client._drain_monitor()
        if self.session._closed_with_connection():
            self._end()
            return
        try:
            self.abort()
            self.collect()
        except AgentServeError:
            self._end()

    def _end(self) -> None:
        self.finished = True
        self.session.client._forget(self.req)

    def _settle(self) -> None:
        """The server's end of a turn given up here (its abort sent), so that the session's next turn is not refused
        as still in progress; not after a drop (the server ended it with the connection), at most ``timeout``."""
        client = self.session.client
        try:
            client._drain_monitor()
            if not self.session._closed_with_connection():
                while not self.ends_turn(client._recv(self.req, client.timeout)):
                    pass
        except AgentServeError:
            pass  # it did not end in time, or the connection dropped meanwhile: the next turn finds out
        self.given_up = False  # not when interrupted (Ctrl-C): the session's next turn waits for it again
        client._forget(self.req)

    def __enter__(self) -> TurnStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
