"""The asyncio client: ``AsyncAgentClient`` → ``AsyncSession`` → ``AsyncTurnStream``.

A reader task owns the receive side and routes events to one queue per request, so any number
of sessions and turns can stream concurrently from one client in one event loop.

    async with AsyncAgentClient(endpoint) as client:
        session = await client.session(system="...")
        async for event in session.turn("Hi!"):
            ...
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any, Unpack

import zmq
import zmq.asyncio

from agentserve.client.errors import AgentServeError, ProtocolViolation, ServerDisconnected
from agentserve.client.events import TurnCore, TurnEvent, TurnResult
from agentserve.client.requests import MessageLike, TurnOptions, open_request
from agentserve.client.transport import ClientBase, SessionBase, connect
from agentserve.protocol.client_messages import (
    Abort,
    GetStats,
    SessionClosed,
    SessionOpened,
    StatsReply,
    Turn,
    Welcome,
)

log = logging.getLogger("agentserve.client")

_DROPPED = object()  # queued for a waiting request when the connection drops
_STOPPED = object()  # queued for every waiting request when the reader task ends (cancelled: the loop shuts down)


class AsyncAgentClient(ClientBase):
    """Asyncio twin of :class:`~agentserve.client.AgentClient` (same timeouts, same errors)."""

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout: float = 10.0,
        event_timeout: float = 300.0,
        heartbeat_ms: int = 1000,
        name: str = "",
    ) -> None:
        super().__init__(zmq.asyncio.Context(), endpoint, timeout, event_timeout, heartbeat_ms)
        self.name = name
        self._queues: dict[int, asyncio.Queue[Any]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._reader_stopped = False
        self.server: Welcome | None = None

    async def connect(self) -> AsyncAgentClient:
        """Connect and handshake; raises :class:`ServerUnavailable` if no server answers."""
        try:
            connect(self._sock, self.endpoint)
            self._tasks = [
                asyncio.create_task(self._read_events()),
                asyncio.create_task(self._read_monitor()),
            ]
            self.server = await self._call(self._hello(self.name), Welcome)
        except BaseException:
            await self.close()
            raise
        return self

    # ---- transport ---------------------------------------------------------------------------

    async def _read_events(self) -> None:
        try:
            await self._read_events_until_stopped()
        finally:  # cancelled (asyncio.run ending on a Ctrl-C cancels every task) or closed: no answer comes now
            self._reader_stopped = True
            for queue in self._queues.values():
                queue.put_nowait(_STOPPED)

    async def _read_events_until_stopped(self) -> None:
        while True:
            payload = await self._sock.recv()
            try:
                event = self._link.decode(payload)
            except ProtocolViolation as e:
                log.warning("%s", e)
                continue
            if event is None:
                continue
            if event.req in self._queues:
                self._queues[event.req].put_nowait(event)
            else:
                self._unclaimed(event)

    async def _read_monitor(self) -> None:
        while True:
            self._link.on_monitor(await self._mon.recv_multipart())
            for req, epoch in self._sent_epoch.items():
                if epoch != self._link.epoch:
                    self._queues[req].put_nowait(_DROPPED)

    async def _send(self, msg: Any, expect_reply: bool = True) -> None:
        if expect_reply:
            self._link.check_answering(msg.req)
        frame = self._link.encode(msg)
        if not await self._sock.poll(int(self.timeout * 1000), zmq.POLLOUT):
            raise self._link.unavailable(self.timeout)
        if expect_reply:
            self._queues[msg.req] = asyncio.Queue()
            self._sent_epoch[msg.req] = self._link.epoch
        await self._sock.send(frame)

    def _send_nowait(self, msg: Any) -> None:
        """Send ``msg`` if the socket takes it now, expecting no reply; never raises, never waits (best effort:
        also from a cancelled task)."""
        with contextlib.suppress(Exception):
            sent = self._sock.send(self._link.encode(msg), zmq.NOBLOCK)
            sent.add_done_callback(lambda f: f.cancelled() or f.exception())  # an error is retrieved, not logged

    async def _recv(self, req: int, timeout: float) -> Any:
        queue = self._queues[req]
        if self._reader_stopped and queue.empty():  # it stopped after this request was sent: nothing more comes
            raise self._stopped(req)
        try:  # asyncio.timeout, not wait_for: on 3.11 a nested wait_for can swallow the caller's own cancellation
            async with asyncio.timeout(timeout):
                event = await queue.get()
        except TimeoutError:
            raise self._link.silent(timeout, req) from None
        if event is _DROPPED:
            self._link.check_epoch(self._sent_epoch[req], req)
        if event is _STOPPED:
            raise self._stopped(req)
        return event

    def _stopped(self, req: int) -> ServerDisconnected:
        return ServerDisconnected(f"request {req}: this client has stopped reading from {self.endpoint} (closed, or "
                                  "its event loop is shutting down)", req=req)

    def _forget(self, req: int) -> list[Any]:
        """Stop routing events to ``req``; returns those that came for it unread."""
        self._sent_epoch.pop(req, None)
        queue = self._queues.pop(req, None)
        unread = [queue.get_nowait() for _ in range(queue.qsize())] if queue is not None else []
        return [event for event in unread if event is not _DROPPED and event is not _STOPPED]

    async def _call(self, msg: Any, expect: type) -> Any:
        await self._send(msg)
        try:
            event = await self._recv(msg.req, self.timeout)
        except BaseException:  # cancelled, timed out: no await before _give_up, so no answer slips past both
            self._give_up(msg, self._forget(msg.req))
            raise
        self._forget(msg.req)
        return self._expect(event, expect, msg.req)

    # ---- API ---------------------------------------------------------------------------------

    async def session(
        self,
        system: str | None = None,
        tools: Iterable[dict[str, Any]] | None = None,
        *,
        name: str = "",
        parse_tool_calls: bool = True,
    ) -> AsyncSession:
        """Open a session.  Cancelled or timed out before its ``SessionOpened`` came, it is closed once that comes."""
        req = open_request(self._next_req(), system, tools, name, parse_tool_calls)
        return AsyncSession(self, await self._call(req, SessionOpened))

    async def stats(self) -> bytes:
        return (await self._call(GetStats(self._next_req()), StatsReply)).snapshot

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, AgentServeError):
                await task
        self._tasks = []
        self._close_sockets()

    async def __aenter__(self) -> AsyncAgentClient:
        return await self.connect()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


class AsyncSession(SessionBase):
    client: AsyncAgentClient

    def __init__(self, client: AsyncAgentClient, opened: SessionOpened) -> None:
        super().__init__(client, opened)
        self._active: AsyncTurnStream | None = None
        self._unsettled: AsyncTurnStream | None = None  # a turn given up here that may still run on the server

    def turn(
        self, messages: str | Iterable[MessageLike] | None = None, **options: Unpack[TurnOptions]
    ) -> AsyncTurnStream:
        """Prepare a turn; it is sent, with the tool results queued by then, when the stream is first iterated or
        collected (a stream never iterated takes none).  An unfinished previous turn of this session is aborted first.
        """
        request = self._state.new_turn(self.client._next_req(), messages, **options)
        stream = AsyncTurnStream(self, request, self._active)
        self._active = stream
        return stream

    async def close(self) -> None:
        if self._state.closed:
            return
        if self._active is not None:
            await self._active.close()  # after a drop: ended at once, nothing sent
        if self._unsettled is not None:
            await self._unsettled._settle()
        if self._closed_with_connection():
            return
        await self.client._call(self._close_request(), SessionClosed)

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, exc_type: Any, *exc: Any) -> None:
        try:
            await self.close()
        except AgentServeError:
            if exc_type is None:
                raise


class AsyncTurnStream(TurnCore):
    def __init__(self, session: AsyncSession, request: Turn, prev: AsyncTurnStream | None) -> None:
        super().__init__(request.req)
        self.session = session
        self._request: Turn | None = request  # None once sent
        self._prev = prev

    async def _start(self) -> None:
        """Send the turn on first use: the previous one ends first, then the tool results queued now go with it."""
        if self._request is None:
            return
        if self.session._unsettled is not None:  # given up, perhaps by a turn that never was sent: see its end
            await self.session._unsettled._settle()
        if self._prev is not None:
            prev, self._prev = self._prev, None
            await prev.close()
        request, self._request = self._request, None
        restore = self._on_error = self.session._state.carry(request)  # its own results, whenever it fails
        try:
            await self.session.client._send(request)
        except BaseException:
            restore()
            raise

    async def __aiter__(self) -> AsyncIterator[TurnEvent]:
        client = self.session.client
        await self._start()
        while not self.finished:
            try:
                try:
                    wire_event = await client._recv(self.req, client.event_timeout)
                except BaseException:  # a timeout, a lost server, Ctrl-C, a cancelled task: it may still run there
                    client._send_nowait(Abort(client._next_req(), self.session.id, self.req))
                    self.given_up = True
                    self.session._unsettled = self
                    raise
                events = self.accept(wire_event)
            except BaseException:
                self.finished = True
                raise
            finally:
                if self.finished and not self.given_up:
                    client._forget(self.req)
            for event in events:
                yield event

    async def collect(self) -> TurnResult:
        async for _ in self:
            pass
        return self.result

    async def abort(self) -> None:
        if not self.finished and self._request is None:
            client = self.session.client
            await client._send(Abort(client._next_req(), self.session.id, self.req), expect_reply=False)

    async def close(self) -> None:
        if self.given_up:
            await self._settle()
            return
        if self.finished or self._request is not None:
            return
        if self.session._closed_with_connection():  # the server ended the turn with the connection: nothing to abort
            self._end()
            return
        try:
            await self.abort()
            await self.collect()
        except AgentServeError:
            self._end()

    def _end(self) -> None:
        self.finished = True
        self.session.client._forget(self.req)

    async def _settle(self) -> None:
        """As the sync client's: the server's end of a turn given up here, before the session's next turn."""
        client = self.session.client
        try:
            if not self.session._closed_with_connection():
                while not self.ends_turn(await client._recv(self.req, client.timeout)):
                    pass
        except AgentServeError:
            pass
        self.given_up = False  # not when cancelled: the session's next turn waits for it again
        if self.session._unsettled is self:
            self.session._unsettled = None
        client._forget(self.req)
