"""Which client owns which session, and which turn each session is running.

The scheduler knows sessions and sequences; the ingress knows client ids.  This table joins the
two for the orchestrator loop: it enforces that a session is used only by the client that opened
it, that a session runs one turn at a time, and it tells what to abort when a client goes away.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from agentserve.orchestrator.protocol import ErrorCode, ProtocolError


@dataclass
class SessionEntry:
    session: int
    client: bytes
    name: str = ""
    turn_req: int = 0  # req of the running turn, 0 when idle
    turns: int = 0  # turns started so far


class ClientTable:
    def __init__(self, first_session_id: int = 1) -> None:
        self._ids = itertools.count(first_session_id)
        self._sessions: dict[int, SessionEntry] = {}
        self._by_client: dict[bytes, set[int]] = {}

    def open(self, client: bytes, name: str = "") -> SessionEntry:
        """Register a new session owned by ``client``; returns it with a fresh id."""
        entry = SessionEntry(next(self._ids), client, name)
        self._sessions[entry.session] = entry
        self._by_client.setdefault(client, set()).add(entry.session)
        return entry

    def get(self, client: bytes, session: int, req: int = 0) -> SessionEntry:
        """The session if ``client`` owns it, else ``ProtocolError(UNKNOWN_SESSION)``."""
        entry = self._sessions.get(session)
        if entry is None or entry.client != client:
            raise ProtocolError(ErrorCode.UNKNOWN_SESSION, f"no session {session} on this connection", req, session)
        return entry

    def begin_turn(self, client: bytes, session: int, req: int) -> SessionEntry:
        """Mark ``req`` as the session's running turn (``TURN_IN_PROGRESS`` if one runs)."""
        entry = self.get(client, session, req)
        if entry.turn_req:
            raise ProtocolError(
                ErrorCode.TURN_IN_PROGRESS,
                f"session {session} is still running turn {entry.turn_req}",
                req,
                session,
            )
        entry.turn_req = req
        entry.turns += 1
        return entry

    def end_turn(self, session: int) -> None:
        entry = self._sessions.get(session)
        if entry is not None:
            entry.turn_req = 0

    def close(self, client: bytes, session: int, req: int = 0) -> SessionEntry:
        """Remove a session the client owns; the caller aborts ``entry.turn_req`` if set."""
        entry = self.get(client, session, req)
        return self._drop(entry)

    def _drop(self, entry: SessionEntry) -> SessionEntry:
        del self._sessions[entry.session]
        owned = self._by_client.get(entry.client)
        if owned is not None:
            owned.discard(entry.session)
            if not owned:
                del self._by_client[entry.client]
        return entry

    def client_gone(self, client: bytes) -> list[SessionEntry]:
        """Remove and return every session of a client that went away."""
        return [self._drop(self._sessions[s]) for s in sorted(self._by_client.get(client, ()))]

    def route(self, session: int) -> SessionEntry | None:
        return self._sessions.get(session)

    def sessions(self) -> list[SessionEntry]:
        return list(self._sessions.values())

    def __len__(self) -> int:
        return len(self._sessions)
