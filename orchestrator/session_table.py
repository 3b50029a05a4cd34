"""Which client owns which session: the ownership and one-turn-at-a-time rules of the ingress.

The scheduler knows sessions and sequences; the ingress knows client ids.  This table joins the
two for the orchestrator loop: a session is used only by the client that opened it (anything else
is ``unknown_session``), a session runs one turn at a time (``turn_in_progress``), and a client that
goes away takes its sessions with it.  Records are the server's own (anything with ``session``,
``client`` and ``running_req``); the table only indexes them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar

from agentserve.protocol.client_messages import ErrorCode, ProtocolError


class SessionLike(Protocol):
    session: int
    client: bytes

    @property
    def running_req(self) -> int:
        """The ``req`` of the session's running turn, 0 when idle."""
        ...


R = TypeVar("R", bound=SessionLike)


class SessionTable(Generic[R]):
    def __init__(self, first_session_id: int = 1) -> None:
        self._ids = itertools.count(first_session_id)
        self._sessions: dict[int, R] = {}
        self._by_client: dict[bytes, set[int]] = {}

    def new_id(self) -> int:
        return next(self._ids)

    def add(self, record: R) -> R:
        self._sessions[record.session] = record
        self._by_client.setdefault(record.client, set()).add(record.session)
        return record

    def owned(self, client: bytes, session: int, req: int = 0) -> R:
        """The session if ``client`` owns it, else ``ProtocolError(UNKNOWN_SESSION)``."""
        record = self._sessions.get(session)
        if record is None or record.client != client:
            raise ProtocolError(ErrorCode.UNKNOWN_SESSION, f"no session {session} on this connection", req, session)
        return record

    def idle(self, client: bytes, session: int, req: int) -> R:
        """The owned session, free to start turn ``req`` (``TURN_IN_PROGRESS`` while another runs)."""
        record = self.owned(client, session, req)
        if record.running_req:
            why = f"session {session} is still running turn {record.running_req}"
            raise ProtocolError(ErrorCode.TURN_IN_PROGRESS, why, req, session)
        return record

    def drop(self, record: R) -> None:
        del self._sessions[record.session]
        owned = self._by_client.get(record.client)
        if owned is not None:
            owned.discard(record.session)
            if not owned:
                del self._by_client[record.client]

    def count(self, client: bytes) -> int:
        """How many sessions ``client`` owns (those still being opened on the worker thread too)."""
        return len(self._by_client.get(client, ()))

    def of_client(self, client: bytes) -> list[R]:
        """Every session ``client`` owns, oldest first."""
        return [self._sessions[s] for s in sorted(self._by_client.get(client, ()))]

    def get(self, session: int) -> R | None:
        return self._sessions.get(session)

    def values(self) -> Iterator[R]:
        return iter(list(self._sessions.values()))

    def __len__(self) -> int:
        return len(self._sessions)
