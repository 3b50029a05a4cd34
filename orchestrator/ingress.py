"""The client ingress: one ZeroMQ ROUTER socket, polled from the orchestrator loop.

``poll(timeout_ms)`` returns decoded, validated requests as ``(client_id, message)`` pairs, and
``(client_id, ClientGone(...))`` once for every client that went away.  Bad input never reaches
the caller: the ingress answers it with a typed :class:`~agentserve.protocol.client_messages.Error`
and keeps running.  ``Hello`` is answered here too (from ``info``).  ``send(client_id, event)``
streams events back; it never blocks.

Disconnect detection (robust without client cooperation): the ROUTER runs ZMTP heartbeats
(libzmq's I/O thread pings every peer and drops a connection whose peer stops answering, e.g. a
stopped or unplugged process; a killed process closes its socket at once), and the socket is
``ROUTER_MANDATORY``, so sending to a client whose connection is gone fails with
``EHOSTUNREACH``.  Every event send is therefore a liveness check, and while a client is quiet
the ingress sends it an empty probe frame every ``probe_interval_s``.  Clients need no thread
and no heartbeat code of their own; a client busy running a tool for minutes stays connected.

Slow and frozen readers: ZeroMQ queues at most ``send_hwm`` events per client (then a send would
block).  Past that, events wait in an ordered per-client backlog of the ingress, flushed on every
poll; a client whose backlog makes no progress for ``stall_timeout_s`` (or grows past
``max_backlog_events``) is reported gone like a vanished one, so its turns are aborted and its KV
freed.  Heartbeats alone cannot catch it: libzmq cannot send a heartbeat while the connection's
socket buffer is full of unread events.

Bounds (``configs/limits.toml``): a frame over ``max_frame_bytes`` is never decoded, and every
field is checked against :class:`~agentserve.protocol.limits.Limits` before the server sees it.
The decoder never lets an exception out: anything undecodable is ``malformed_frame``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import stat
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from agentserve.orchestrator.limits import ClientRules
from agentserve.protocol.client_messages import (
    PROTOCOL_VERSION,
    ClientMessage,
    Error,
    ErrorCode,
    Hello,
    OpenSession,
    ProtocolError,
    ServerCodec,
    ServerEvent,
    Welcome,
    validate,
)
from agentserve.protocol.endpoints import EndpointError, check_bind, default_endpoint, ipc_path
from agentserve.protocol.limits import Limits, check_limits

log = logging.getLogger("agentserve.ingress")

CLOSE_LINGER_MS = 500


class ClientGone(msgspec.Struct, frozen=True):
    """Not a wire message: the ingress reports that a client's connection is gone."""

    reason: str = "disconnected"


Request = ClientMessage | ClientGone


def _refuse_live_ipc(path: str) -> None:
    """libzmq silently replaces an existing file: refuse anything but a socket, and a socket a server listens on."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise EndpointError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # a stale file from a dead run
        return
    finally:
        probe.close()
    raise EndpointError(f"another server is already listening on ipc://{path}")


class Ingress:
    """A ROUTER socket speaking the AgentServe wire protocol.  Not thread-safe: one owner loop."""

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        info: Welcome | None = None,
        allow_remote: bool = False,
        limits: Limits | None = None,
        rules: ClientRules | None = None,
        context: zmq.Context | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        endpoint = check_bind(endpoint or default_endpoint(), allow_remote=allow_remote)
        self.info = info or Welcome(req=0, version=0)
        self.limits = limits or Limits()
        self.rules = rules or ClientRules()
        self.counters: Counter[str] = Counter()
        self._clock = clock
        self._codec = ServerCodec(self.limits.max_frame_bytes)
        self._own_ctx = context is None
        self._ctx = context or zmq.Context()
        self._clients: dict[bytes, float] = {}  # client id → last time we heard from / reached it
        self._backlog: dict[bytes, deque[bytes]] = {}  # events ZeroMQ would not take yet, in order
        self._progress: dict[bytes, float] = {}  # a backlogged client → last time one of its sends went through
        self._gone: list[tuple[bytes, Request]] = []
        self._next_probe = clock() + self.rules.probe_interval_s
        self._ipc_file: str | None = None
        self.socket = self._bind(endpoint)
        log.info("ingress listening on %s", self.endpoint)

    def _bind(self, endpoint: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, self.rules.send_hwm)  # then the ingress's own backlog, with a stall deadline
        sock.setsockopt(zmq.RCVHWM, 0)
        # a frame up to 4x the bound gets a typed error; beyond, libzmq drops the connection before buffering it
        sock.setsockopt(zmq.MAXMSGSIZE, 4 * self.limits.max_frame_bytes)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.HEARTBEAT_IVL, self.rules.heartbeat_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, self.rules.heartbeat_timeout_ms)
        path = ipc_path(endpoint)
        try:
            if path is not None:
                _refuse_live_ipc(str(path))
            sock.bind(endpoint)
        except (zmq.ZMQError, EndpointError, OSError) as e:  # e.g. the path's folder is a file
            sock.close(linger=0)
            if self._own_ctx:
                self._ctx.term()
            raise EndpointError(f"cannot bind {endpoint}: {e}") from None
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT) if path is None else endpoint
        self._ipc_file = str(path) if path is not None else None
        return sock

    # ---- receiving ---------------------------------------------------------------------------

    def poll(self, timeout_ms: int = 0, max_messages: int = 256) -> list[tuple[bytes, Request]]:
        """Wait up to ``timeout_ms`` for input; return what arrived (at most ``max_messages``)."""
        out, self._gone = self._gone, []
        if out:
            timeout_ms = 0
        if self.socket.poll(timeout_ms, zmq.POLLIN):
            for _ in range(max_messages):
                try:
                    frames = self.socket.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                item = self._handle(frames)
                if item is not None:
                    out.append(item)
        self._flush()
        self._probe()
        out.extend(self._gone)
        self._gone = []
        return out

    def _handle(self, frames: list[bytes]) -> tuple[bytes, Request] | None:
        cid = frames[0]
        self._clients[cid] = self._clock()
        self.counters["frames"] += 1
        if len(frames) != 2:
            err = ProtocolError(ErrorCode.MALFORMED_FRAME, f"expected 1 frame, got {len(frames) - 1}")
            self._reject(cid, err)
            return None
        if not frames[1]:
            return None  # an empty frame: a client keepalive, nothing to do
        try:
            msg = self._codec.decode(frames[1])
            check_limits(msg, self.limits, self._tools_bytes(msg, len(frames[1])))
            validate(msg)
        except ProtocolError as e:
            self._reject(cid, e)
            return None
        except (TypeError, ValueError, OverflowError, RecursionError) as e:  # a value no check foresaw: this client's
            log.warning("request from client %s could not be checked: %s: %s", cid.hex(), type(e).__name__, e)
            self._reject(cid, ProtocolError(ErrorCode.INVALID_REQUEST, f"the request cannot be checked: {e}"))
            return None
        if isinstance(msg, Hello):
            self.send(cid, msgspec.structs.replace(self.info, req=msg.req, version=PROTOCOL_VERSION,
                                                   limits=self.limits.as_dict()))  # the limits it enforces
            return None
        return cid, msg

    def _tools_bytes(self, msg: object, frame_bytes: int) -> int:
        """The msgpack size of a session's tools (re-encoded only when the frame could be over the bound)."""
        if not isinstance(msg, OpenSession) or frame_bytes <= self.limits.max_tool_bytes:
            return 0
        return len(msgspec.msgpack.encode(msg.tools))

    def _reject(self, cid: bytes, err: ProtocolError) -> None:
        self.counters[f"error.{err.code.value}"] += 1
        log.debug("rejected a frame from %s: %s %s", cid.hex(), err.code.value, err)
        self.send(cid, err.to_event())

    # ---- sending -----------------------------------------------------------------------------

    def send(self, client_id: bytes, event: ServerEvent) -> bool:
        """Send one event; False (and a ClientGone on the next poll) if the client is gone."""
        return self._send_raw(client_id, self._codec.encode(event))

    def send_error(self, client_id: bytes, code: ErrorCode, message: str, req: int = 0, session: int = 0) -> bool:
        self.counters[f"error.{ErrorCode(code).value}"] += 1
        return self.send(client_id, Error(req=req, code=code, message=message, session=session))

    def _send_raw(self, cid: bytes, payload: bytes) -> bool:
        if cid in self._backlog:  # behind what already waits: order is kept
            return self._enqueue(cid, payload)
        sent = self._try_send(cid, payload)
        if sent is None:
            self._progress[cid] = self._clock()
            return self._enqueue(cid, payload)
        return sent

    def _try_send(self, cid: bytes, payload: bytes) -> bool | None:
        """True: sent; False: the client is gone; None: ZeroMQ's queue for it is full."""
        try:
            self.socket.send_multipart([cid, payload], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            if e.errno == errno.EHOSTUNREACH:
                self._mark_gone(cid)
                return False
            if e.errno == errno.EAGAIN:
                return None
            raise
        if cid in self._clients:
            self._clients[cid] = self._clock()
        return True

    def _enqueue(self, cid: bytes, payload: bytes) -> bool:
        queue = self._backlog.setdefault(cid, deque())
        if len(queue) >= self.rules.max_backlog_events:
            self._mark_gone(cid, f"not reading: {len(queue)} events undelivered", "stalled")
            return False
        queue.append(payload)
        return True

    def _flush(self) -> None:
        """Retry every backlog in order; drop a client whose backlog made no progress for the stall timeout."""
        now = self._clock()
        for cid, queue in list(self._backlog.items()):
            sent = None
            while queue and (sent := self._try_send(cid, queue[0])):
                queue.popleft()
                self._progress[cid] = now
            if sent is False or cid not in self._backlog:
                continue  # gone: _mark_gone cleared it
            if not queue:
                del self._backlog[cid], self._progress[cid]
            elif now - self._progress[cid] >= self.rules.stall_timeout_s:
                why = f"not reading: {len(queue)} events undelivered for {now - self._progress[cid]:.1f} s"
                self._mark_gone(cid, why, "stalled")

    def _mark_gone(self, cid: bytes, why: str = "disconnected", reason: str = "disconnected") -> None:
        self._backlog.pop(cid, None)
        self._progress.pop(cid, None)
        if self._clients.pop(cid, None) is not None:  # report each known client once
            self.counters[f"clients_{reason}"] += 1
            log.info("client %s gone: %s", cid.hex(), why)
            self._gone.append((cid, ClientGone(reason)))

    def _probe(self) -> None:
        now = self._clock()
        if now < self._next_probe:
            return
        self._next_probe = now + self.rules.probe_interval_s
        for cid, seen in list(self._clients.items()):
            if now - seen >= self.rules.probe_interval_s and cid not in self._backlog:
                self._send_raw(cid, b"")

    # ---- lifecycle ---------------------------------------------------------------------------

    @property
    def clients(self) -> set[bytes]:
        """Client ids the ingress has heard from and not yet reported gone."""
        return set(self._clients)

    @property
    def backlogged(self) -> int:
        """Events waiting for clients that are not reading fast enough."""
        return sum(len(q) for q in self._backlog.values())

    def forget(self, client_id: bytes) -> None:
        """Stop probing a client (e.g. it closed all its sessions)."""
        self._clients.pop(client_id, None)
        self._backlog.pop(client_id, None)
        self._progress.pop(client_id, None)

    def close(self) -> None:
        """Close the socket; remove the ipc socket file.  Idempotent."""
        if self.socket.closed:
            return
        self.socket.close(linger=CLOSE_LINGER_MS)  # the last events (server_shutdown, executor_failed) still go out
        if self._own_ctx:
            self._ctx.term()
        if self._ipc_file is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._ipc_file)
        log.info("ingress on %s closed", self.endpoint)

    def __enter__(self) -> Ingress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
