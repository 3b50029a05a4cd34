"""The SDKs against a real server loop (fake executor): a stream given up on the client side (Ctrl-C, a timeout, a
cancelled task) stops its turn on the server too, and tool results a failed turn carried are sent again."""

from __future__ import annotations

import asyncio
import time

import pytest
from server_harness import TOKEN, serving, wait_until

from agentserve.client import AgentClient, AsyncAgentClient, ExecutorFailed


@pytest.fixture()
def slow(tmp_path):
    """Each plan takes 5 ms on the fake executor: a turn of 2,000 tokens runs for about ten seconds."""
    with serving(tmp_path) as (endpoint, link, server):
        real = link.send

        def send(msg: object) -> None:
            time.sleep(0.005)
            real(msg)

        link.send = send
        yield endpoint, link, server


def test_a_stream_interrupted_on_the_client_stops_its_turn(slow, monkeypatch) -> None:
    endpoint, _, _ = slow
    with AgentClient(endpoint) as client, client.session(system="sys") as s:
        stream = s.turn("a long one", max_tokens=2000, ignore_eos=True)
        real, calls = client._recv, [0]

        def interrupted(req: int, timeout: float):
            calls[0] += 1
            if calls[0] == 3:
                raise KeyboardInterrupt
            return real(req, timeout)

        monkeypatch.setattr(client, "_recv", interrupted)
        with pytest.raises(KeyboardInterrupt):
            stream.collect()
        monkeypatch.setattr(client, "_recv", real)
        # the turn was stopped, so the session takes the next one (it once answered turn_in_progress)
        assert s.turn("next", max_tokens=2, ignore_eos=True).collect().token_ids == [TOKEN] * 2


def test_a_cancelled_async_stream_stops_its_turn(slow) -> None:
    endpoint, _, _ = slow

    async def run() -> list[int]:
        async with AsyncAgentClient(endpoint) as client, await client.session(system="sys") as s:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(s.turn("a long one", max_tokens=2000, ignore_eos=True).collect(), 0.2)
            return (await s.turn("next", max_tokens=2, ignore_eos=True).collect()).token_ids

    assert asyncio.run(run()) == [TOKEN] * 2


def test_tool_results_a_failed_turn_carried_go_with_the_retry(tmp_path) -> None:
    with serving(tmp_path) as (endpoint, link, server), AgentClient(endpoint) as client, \
            client.session(system="sys") as s:
        s.turn("call a tool", max_tokens=2, ignore_eos=True).collect()
        s.tool_result("call_1", "42", name="lookup")
        link.failing = True
        with pytest.raises(ExecutorFailed):
            s.turn(max_tokens=2, ignore_eos=True).collect()
        link.failing = False
        s.turn(max_tokens=2, ignore_eos=True).collect()  # once an empty turn: invalid_request
        (rec,) = server.sessions.values()  # the server commits the turn just after sending its Done

        def tool_messages() -> list[str]:
            return [m["content"] for m in rec.conversation.messages if m["role"] == "tool"]

        wait_until(lambda: tool_messages() == ["42"], 5.0)
        assert tool_messages() == ["42"]


def test_each_failed_turn_puts_back_only_its_own_tool_results() -> None:
    """Turn B may be sent before turn A has failed: if A then fails, A's results (not B's) wait again."""
    from agentserve.client.requests import SessionState

    state = SessionState(1)
    state.tool_result("a", "RA")
    restore_a = state.carry(state.new_turn(1))
    state.tool_result("b", "RB")
    b = state.new_turn(2)
    state.carry(b)
    assert [m.content for m in b.messages] == ["RB"]
    restore_a()
    assert [m.content for m in state.pending] == ["RA"]


def test_a_session_reset_mid_turn_takes_its_next_turn_at_once(slow, monkeypatch) -> None:
    """A reset session's old scheduler session drains its plans in flight; a retry meanwhile opens a new one under
    its own id (the same id was refused as still open: the retry got `internal`)."""
    from agentserve.client import InternalError
    from agentserve.orchestrator.running_turn import RunningTurn

    endpoint, _, _ = slow
    real, calls = RunningTurn.on_token, [0]

    def flaky(self, token_id, t, *logprobs):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("detokenizer bug")
        return real(self, token_id, t, *logprobs)

    monkeypatch.setattr(RunningTurn, "on_token", flaky)
    with AgentClient(endpoint) as client, client.session(system="sys") as s:
        with pytest.raises(InternalError, match="detokenizer bug"):
            s.turn("a long one", max_tokens=2000, ignore_eos=True).collect()
        assert s.turn("again", max_tokens=2, ignore_eos=True).collect().token_ids == [TOKEN] * 2


def test_a_session_whose_opening_was_cancelled_is_closed_once_open(tmp_path, monkeypatch) -> None:
    """The server opens a session whatever became of the request; a cancelled ``session()`` (an HTTP client that
    disconnected, a timeout) closes it once it is open instead of leaving it there."""
    from agentserve.orchestrator.server import Server

    real = Server._open

    def slow_open(self, client, msg):
        time.sleep(0.3)  # the request is in; its answer is late
        return real(self, client, msg)

    monkeypatch.setattr(Server, "_open", slow_open)
    with serving(tmp_path) as (endpoint, _, server):

        async def run() -> None:
            async with AsyncAgentClient(endpoint) as client:
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(client.session(system="sys"), 0.1)
                await asyncio.sleep(0.5)  # the server has opened it; its SessionOpened arrives
                wait_until(lambda: len(server.sessions) == 0, 5.0)

        asyncio.run(run())
