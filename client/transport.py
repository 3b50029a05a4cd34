"""Socket set-up and connection tracking shared by the sync and asyncio clients.

A client is one DEALER socket.  ``IMMEDIATE`` keeps requests from queueing while no server is
connected (a send then times out with a clear error instead of waiting forever), ZMTP heartbeats
drop the connection to a server that stopped answering, and a socket monitor turns connection
drops into :class:`ServerDisconnected` for every request still waiting.  Empty frames from the
server are liveness probes and are dropped here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from agentserve.client.errors import (
    InvalidEndpoint,
    InvalidRequest,
    ProtocolViolation,
    ServerDisconnected,
    ServerShutdown,
    ServerUnavailable,
    from_event,
)
from agentserve.client.requests import ReqCounter, SessionState
from agentserve.protocol.client_messages import (
    PROTOCOL_VERSION,
    ClientCodec,
    CloseSession,
    Error,
    ErrorCode,
    Hello,
    OpenSession,
    ProtocolError,
    SessionOpened,
)
from agentserve.protocol.endpoints import EndpointError, check_endpoint, default_endpoint

MONITOR_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


def make_socket(ctx: zmq.Context, endpoint: str | None, heartbeat_ms: int = 1000) -> tuple[zmq.Socket, str]:
    endpoint = endpoint or default_endpoint()
    try:  # its form only: a client may connect anywhere, and waits for a socket (or its folder) to appear
        check_endpoint(endpoint)
    except EndpointError as e:
        raise InvalidEndpoint(str(e)) from None
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_ms)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * heartbeat_ms)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    return sock, endpoint


def connect(sock: zmq.Socket, endpoint: str) -> None:
    """``sock.connect``, with what libzmq refuses (an IPv6 address while IPv6 is off, ...) a typed error."""
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as e:
        raise InvalidEndpoint(f"cannot connect to {endpoint!r}: {e}") from None


ERROR_TAG = Error.__struct_config__.tag


def _error_of_unknown_code(payload: bytes) -> Error | None:
    """An ``error`` event whose code this SDK does not know (a newer server's): still its request's error, with
    the code kept as text, instead of an undecodable frame that leaves the request waiting for its timeout."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        return None
    if not (isinstance(raw, list) and len(raw) >= 4 and raw[0] == ERROR_TAG  # later fields: an even newer server's
            and all(isinstance(v, t) for v, t in zip(raw[1:], (int, str, str, int, str), strict=False))):
        return None
    session, param = (raw[4] if len(raw) > 4 else 0), (raw[5] if len(raw) > 5 else "")
    return Error(req=raw[1], code=raw[2], message=raw[3], session=session, param=param)


class Link:
    """Connection epoch bookkeeping: a request sent in an older epoch lost its server.  A server that ends its turns
    with ``server_shutdown`` answers nothing more on that connection: until it drops (a new epoch), a request that
    expects an answer is refused at once and a session's close has nothing to wait for."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.epoch = 0
        self.codec = ClientCodec()
        self.shut_down_in: int | None = None  # the epoch in which the server said it is shutting down

    def shutting_down(self) -> bool:
        return self.shut_down_in == self.epoch

    def encode(self, msg: Any) -> bytes:
        """``msg``'s frame; an integer past 64 bits (a seed, a token id) is :class:`InvalidRequest`, not msgpack's
        ``OverflowError``."""
        try:
            return self.codec.encode(msg)
        except OverflowError:
            raise InvalidRequest(f"request {msg.req}: an integer in it does not fit in 64 bits", req=msg.req) from None

    def check_answering(self, req: int) -> None:
        if self.shutting_down():
            raise ServerShutdown(f"the server at {self.endpoint} is shutting down", req=req)

    def on_monitor(self, frames: list[bytes]) -> None:
        if parse_monitor_message(frames)["event"] == zmq.EVENT_DISCONNECTED:
            self.epoch += 1

    def decode(self, payload: bytes):  # -> ServerEvent | None
        if not payload:
            return None
        try:
            event = self.codec.decode(payload)
        except ProtocolError as e:
            newer = _error_of_unknown_code(payload)
            if newer is not None:
                return newer
            raise ProtocolViolation(f"undecodable event from the server: {e}") from None
        if isinstance(event, Error) and event.code is ErrorCode.SERVER_SHUTDOWN:
            self.shut_down_in = self.epoch
        return event

    def check_epoch(self, sent_epoch: int, req: int) -> None:
        if self.epoch != sent_epoch:
            raise ServerDisconnected(
                f"the connection to the server at {self.endpoint} dropped before request {req} was answered",
                req=req,
            )

    def unavailable(self, timeout: float) -> ServerUnavailable:
        return ServerUnavailable(
            f"no AgentServe server answered at {self.endpoint} within {timeout:g} s "
            "(is `agentserve up` running with this endpoint?)"
        )

    def silent(self, timeout: float, req: int) -> ServerUnavailable:
        return ServerUnavailable(
            f"the server at {self.endpoint} sent nothing for request {req} in {timeout:g} s", req=req
        )


class ClientBase:
    """State and helpers shared by the sync and asyncio clients (the I/O differs, nothing else)."""

    def __init__(
        self, ctx: zmq.Context, endpoint: str | None, timeout: float, event_timeout: float, heartbeat_ms: int
    ) -> None:
        if not (timeout > 0 and event_timeout > 0 and heartbeat_ms > 0):
            raise ValueError(f"timeouts must be > 0: timeout={timeout}, event_timeout={event_timeout}, "
                             f"heartbeat_ms={heartbeat_ms}")
        self.timeout = timeout
        self.event_timeout = event_timeout
        self._ctx = ctx
        self._sock, self.endpoint = make_socket(ctx, endpoint, heartbeat_ms)
        self._mon = self._sock.get_monitor_socket(MONITOR_EVENTS)
        self._link = Link(self.endpoint)
        self._sent_epoch: dict[int, int] = {}
        self._next_req = ReqCounter()
        self._given_up_opens: set[int] = set()  # reqs of opens whose answer nobody waits for any more
        self._given_up_epoch = 0  # the connection epoch they were given up in

    def _send_nowait(self, msg: Any) -> None:
        """Send ``msg`` if the socket takes it now, expecting no reply; never raises (best effort)."""
        raise NotImplementedError

    def _give_up(self, msg: Any, arrived: Iterable[Any]) -> None:
        """The caller stopped waiting for ``msg``'s answer (Ctrl-C, a timeout, a cancelled task); ``arrived``: what
        had come for it unread.  The server opens a session whatever became of the request, so an open's
        ``SessionOpened`` is answered with a close: now if it is in, else once it comes (:meth:`_unclaimed`).
        Those given up on a connection that has since dropped are forgotten: their answers never come, and the
        server closed the sessions of the connection it lost."""
        if isinstance(msg, OpenSession):
            if self._given_up_epoch != self._link.epoch:
                self._given_up_opens.clear()
                self._given_up_epoch = self._link.epoch
            self._given_up_opens.add(msg.req)
            for event in arrived:
                self._unclaimed(event)

    def _unclaimed(self, event: Any) -> None:
        """An event of a request nobody waits for: a given-up open's answer closes what it opened; the
        rest (late events of finished requests) are dropped."""
        if event.req not in self._given_up_opens:
            return
        self._given_up_opens.discard(event.req)
        if isinstance(event, SessionOpened):
            self._send_nowait(CloseSession(self._next_req(), event.session))

    def _hello(self, name: str) -> Hello:
        return Hello(self._next_req(), PROTOCOL_VERSION, name)

    @staticmethod
    def _expect(event: Any, expect: type, req: int) -> Any:
        if isinstance(event, Error):
            raise from_event(event)
        if not isinstance(event, expect):
            raise ProtocolViolation(f"expected {expect.__name__}, got {type(event).__name__}", req=req)
        return event

    def _close_sockets(self) -> None:
        if not self._sock.closed:
            self._sock.disable_monitor()
            self._mon.close(linger=0)
            self._sock.close(linger=0)
            self._ctx.term()


class SessionBase:
    """What a session is on the client side, independent of the transport."""

    def __init__(self, client: Any, opened: SessionOpened) -> None:
        self.client = client
        self.id = opened.session
        self.prompt_tokens = opened.prompt_tokens
        self._state = SessionState(opened.session)
        self._epoch = client._link.epoch  # the connection it lives on: the server closes it when that drops

    def _closed_with_connection(self) -> bool:
        """Whether the connection it was opened on dropped, which closed it on the server, or the server said it is
        shutting down (then it is marked closed: a close has nothing to send, and must not wait for a server that
        answers no more)."""
        link = self.client._link
        if link.epoch != self._epoch or link.shutting_down():
            self._state.closed = True
        return self._state.closed

    def tool_result(self, call_id: str, content: Any, name: str = "") -> None:
        """Queue a tool's output; it is sent as a ``tool`` message with the next turn (``content`` that is not a str
        as JSON)."""
        self._state.tool_result(call_id, content, name)

    def _close_request(self) -> CloseSession:
        self._state.closed = True
        return CloseSession(self.client._next_req(), self.id)
