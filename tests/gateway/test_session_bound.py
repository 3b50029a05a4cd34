"""The orchestrator's per-connection session bound (``limits.clients.max_sessions``) as the gateway meets it: the
gateway's one connection holds every filed conversation's session, so a refused open closes the conversation filed
longest ago and retries; with nothing filed (every session a request in flight) the answer is 503, retryable."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from agentserve.client import LimitExceeded, ServerBusy
from agentserve.gateway.backend import Backend, GatewayOptions
from agentserve.gateway.errors import from_client_error
from agentserve.protocol.limits import SESSION_LIMIT

from .conftest import HttpServer


class _Session:
    def __init__(self, sid: int, server: _Server) -> None:
        self.id, self.server = sid, server

    async def close(self) -> None:
        self.server.open.discard(self.id)


class _Server:
    """Holds at most ``bound`` sessions for its one client, as the orchestrator does."""

    def __init__(self, bound: int) -> None:
        self.bound, self.open, self.next = bound, set(), 0

    async def session(self, **_) -> _Session:
        if len(self.open) >= self.bound:
            raise LimitExceeded(f"this connection holds {len(self.open)} open sessions ({SESSION_LIMIT})")
        self.next += 1
        self.open.add(self.next)
        return _Session(self.next, self)


def _backend(server: _Server) -> Backend:
    backend = Backend(GatewayOptions(endpoint="ipc:///unused"))
    backend.client, backend.welcome, backend.tokenizer = server, SimpleNamespace(), SimpleNamespace()
    return backend


def test_a_refused_open_closes_the_conversation_filed_longest_ago_and_retries() -> None:
    async def scenario() -> None:
        server = _Server(bound=3)
        backend = _backend(server)
        first = await backend.open_session("sys")
        backend.conversations.file(b"a" * 20, first)
        raw = await backend.open_session(name="http-completions", parse_tool_calls=False)
        backend.token_conversations.file([1, 2, 3], raw)
        running = await backend.open_session("sys")  # a request in flight: never closed for another
        fresh = await backend.open_session("sys")  # the bound is reached: the oldest filed one goes
        assert server.open == {raw.id, running.id, fresh.id} and len(backend.conversations) == 0
        await backend.open_session("sys")  # then the raw-token map's
        assert len(backend.token_conversations) == 0 and running.id in server.open
        with pytest.raises(ServerBusy, match="in flight"):  # nothing filed any more
            await backend.open_session("sys")

    asyncio.run(scenario())


def test_an_open_at_the_bound_waits_for_closes_under_way_before_closing_a_filed_conversation() -> None:
    """An abandoned stream's session is being closed in the background when a new conversation arrives at the bound:
    the open waits for that close instead of closing a filed conversation (before: the filed one was closed too, or
    with none filed the answer was 503 busy while a session was about to be freed)."""

    class _SlowClose(_Session):
        async def close(self) -> None:
            await asyncio.sleep(0.2)
            await super().close()

    async def scenario() -> None:
        server = _Server(bound=2)
        backend = _backend(server)
        filed = await backend.open_session("sys")
        backend.conversations.file(b"a" * 20, filed)
        abandoned = await backend.open_session("sys")
        backend.close_later(_SlowClose(abandoned.id, server))
        fresh = await backend.open_session("sys")
        assert server.open == {filed.id, fresh.id} and len(backend.conversations) == 1
        backend.close_later(_SlowClose(fresh.id, server))  # with nothing filed but a close under way: not busy
        backend.conversations.drain()
        again = await backend.open_session("sys")
        assert again.id in server.open

    asyncio.run(scenario())


def test_other_limits_are_not_taken_for_the_session_bound() -> None:
    class _Refusing(_Server):
        async def session(self, **_) -> _Session:
            raise LimitExceeded("tools: 300 exceeds the limit of 256 (limits.request.max_tools)")

    async def scenario() -> None:
        backend = _backend(_Refusing(bound=3))
        backend.conversations.file(b"a" * 20, _Session(1, _Server(1)))
        with pytest.raises(LimitExceeded, match="max_tools"):
            await backend.open_session("sys")
        assert len(backend.conversations) == 1  # nothing closed for it

    asyncio.run(scenario())


def test_busy_is_a_503_the_openai_sdks_retry() -> None:
    assert from_client_error(ServerBusy("x")).status == 503


def test_conversations_past_a_low_session_bound_are_still_served(tmp_path, monkeypatch) -> None:
    """A real server whose connections may hold 3 sessions: six new conversations in a row, each filed after its
    reply, all answered (before: the fourth was a 400 until the filed ones went idle for 10 minutes)."""
    import httpx

    monkeypatch.setenv("AGENTSERVE_CLIENTS_MAX_SESSIONS", "3")
    server = HttpServer(tmp_path)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            for i in range(6):
                r = http.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": f"conversation {i}"}], "max_tokens": 2})
                assert r.status_code == 200, r.text
            r = http.post("/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 2})
            assert r.status_code == 200, r.text
        assert len(server.snapshot().sessions) <= 3
    finally:
        assert server.stop() == 0, server.logs()
