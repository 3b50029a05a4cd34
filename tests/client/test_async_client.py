"""The asyncio SDK against the echo server."""

from __future__ import annotations

import asyncio

import pytest
from agent_fake_server import EchoServer, recording_sends_async

from agentserve.client import (
    AsyncAgentClient,
    InvalidSampling,
    ServerDisconnected,
    ServerShutdown,
    ServerUnavailable,
    TextDelta,
    TokenIds,
)
from agentserve.protocol.client_messages import FinishReason, OpenSession
from agentserve.protocol.stats import decode_snapshot


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_streams_text_and_token_ids(server):
    async def main():
        async with AsyncAgentClient(server.endpoint) as client:
            assert client.server.model == "echo"
            async with await client.session(system="s") as s:
                return [e async for e in s.turn("héllo")]

    events = run(main())
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    ids = [t for e in events if isinstance(e, TokenIds) for t in e.token_ids]
    assert ids == list("héllo".encode())
    assert len(text) == len(ids)  # the echo engine detokenizes byte-wise
    assert events[-1].finish is FinishReason.STOP


def test_many_concurrent_agents_on_one_client(server):
    async def agent(client, i):
        async with await client.session(name=f"agent-{i}") as s:
            first = await s.turn("CALL 1+1").collect()
            (call,) = first.tool_calls
            s.tool_result(call.id, f"result-{i}")
            second = await s.turn().collect()
            raw = await s.turn(token_ids=[i + 1], ignore_eos=True, max_tokens=3).collect()
            return first.finish, second.text, raw.token_ids

    async def main():
        async with AsyncAgentClient(server.endpoint) as client:
            return await asyncio.gather(*(agent(client, i) for i in range(6)))

    results = run(main())
    for i, (finish, text, raw) in enumerate(results):
        assert finish is FinishReason.TOOL_CALLS
        assert text == f"result-{i}"
        assert raw == [i + 1] * 3


def test_typed_error_then_recovery(server):
    async def main():
        async with AsyncAgentClient(server.endpoint) as client:
            s = await client.session()
            with pytest.raises(InvalidSampling, match="top_k"):
                await s.turn("x", top_k=-1).collect()
            return (await s.turn("ok").collect()).text

    assert run(main()) == "ok"


def test_abort(slow_server):
    async def main():
        async with AsyncAgentClient(slow_server.endpoint) as client:
            s = await client.session()
            stream = s.turn("q" * 300)
            n = 0
            async for _ in stream:
                n += 1
                if n == 2:
                    await stream.abort()
            return stream.result

    res = run(main())
    assert res.finish is FinishReason.ABORT and len(res.token_ids) < 300


def test_no_server(tmp_path):
    async def main():
        await AsyncAgentClient(f"ipc://{tmp_path}/none.sock", timeout=0.3).connect()

    with pytest.raises(ServerUnavailable):
        run(main())


def test_server_death_mid_stream(endpoint):
    srv = EchoServer(endpoint, token_delay_s=0.02).__enter__()

    async def main():
        async with AsyncAgentClient(endpoint) as client:
            s = await client.session()
            stream = s.turn("w" * 500)
            async for _ in stream:
                srv.stop()

    with pytest.raises(ServerDisconnected):
        run(main())


def test_a_session_of_a_dropped_connection_closes_without_waiting_for_the_server(endpoint):
    """As in the sync client: ``async with session`` after ``ServerDisconnected`` sends no close to the dead
    server (it waited out ``timeout`` before the caller saw the error)."""
    srv = EchoServer(endpoint, token_delay_s=0.02).__enter__()
    sent = []

    async def main():
        async with AsyncAgentClient(endpoint, timeout=20) as client:
            recording = recording_sends_async(client, sent)

            async with await client.session() as s:
                async for _ in s.turn("w" * 500):
                    srv.stop()
                    client._send = recording

    with pytest.raises(ServerDisconnected):
        run(main())
    assert sent == []


def test_after_server_shutdown_a_session_closes_at_once_and_new_requests_are_refused(endpoint):
    """As in the sync client: after ``server_shutdown`` nothing is answered, so ``async with session`` sends no
    close and a new session is refused at once (each would have waited out ``timeout``, 20 s here)."""
    sent = []

    async def main():
        async with AsyncAgentClient(endpoint, timeout=20) as client:
            recording = recording_sends_async(client, sent)

            with pytest.raises(ServerShutdown):
                async with await client.session() as s:
                    client._send = recording
                    async for _ in s.turn("w" * 500):
                        srv.shut_down()
            assert sent == ["Turn"]
            with pytest.raises(ServerShutdown):
                await client.session()

    with EchoServer(endpoint, token_delay_s=0.02) as srv:
        run(main())  # within run's 30 s only if neither waited out the 20 s timeout


def test_a_turn_given_up_on_the_client_lets_the_sessions_next_turn_start(endpoint):
    """As in the sync client, for a timeout and for a cancelled task: the next turn waits for the aborted one's end
    on the server instead of being refused as still in progress."""

    async def main():
        async with AsyncAgentClient(endpoint, event_timeout=0.05) as client, await client.session() as s:
            with pytest.raises(ServerUnavailable):
                await s.turn("w" * 50).collect()
            assert srv.gens
            client.event_timeout = 10
            task = asyncio.create_task(s.turn("w" * 50).collect())
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert srv.gens
            assert (await s.turn("ok").collect()).text == "ok"
            assert not client._queues

    with EchoServer(endpoint, token_delay_s=0.2, lazy_abort=True) as srv:
        run(main())


def test_once_its_reader_is_cancelled_a_request_fails_at_once(server):
    """``asyncio.run`` ending on a Ctrl-C cancels every task, the client's reader among them: a session's close in an
    agent's ``finally`` then waited out ``timeout`` (10 s per agent) for an answer nobody would read."""

    async def main():
        async with AsyncAgentClient(server.endpoint, timeout=20) as client:
            s = await client.session()
            waiting = asyncio.create_task(client.stats())  # sent, its answer not read yet
            await asyncio.sleep(0)
            client._tasks[0].cancel()
            with pytest.raises(ServerDisconnected, match="stopped reading"):
                await waiting
            with pytest.raises(ServerDisconnected, match="stopped reading"):
                await s.close()

    run(main())  # within run's 30 s only if neither waited out the 20 s timeout


@pytest.mark.parametrize("closed", ["turn", "session"])
def test_closing_after_a_drop_sends_nothing_and_ends_the_turn(endpoint, closed):
    """As in the sync client: once the drop is known, ``close`` of the turn sends no abort to the dead server, and
    ``close`` of its session ends the unread turn (its queue kept collecting the monitor's drop markers)."""
    srv = EchoServer(endpoint, token_delay_s=0.02).__enter__()
    sent = []

    async def main():
        async with AsyncAgentClient(endpoint, timeout=20) as client:
            s = await client.session()
            stream = s.turn("w" * 500)
            await anext(aiter(stream))
            srv.stop()
            for _ in range(3000):  # the drop, as the monitor task reports it
                if client._link.epoch:
                    break
                await asyncio.sleep(0.01)
            recording = recording_sends_async(client, sent)

            client._send = recording
            await (stream if closed == "turn" else s).close()
            return stream, client

    stream, client = run(main())
    assert sent == [] and stream.finished
    assert stream.req not in client._queues and stream.req not in client._sent_epoch


def test_a_turn_never_iterated_takes_no_tool_results(server):
    """Queued tool results go with the turn that is sent, not with one built and dropped unsent."""

    async def main():
        async with AsyncAgentClient(server.endpoint) as client, await client.session() as s:
            (call,) = (await s.turn("CALL 1+1").collect()).tool_calls
            s.tool_result(call.id, "2")
            s.turn()  # built, never iterated: never sent
            return (await s.turn().collect()).text

    assert run(main()) == "2"
    assert [(m.role, m.content) for m in server.turn_requests[-1].messages] == [("tool", "2")]


async def _sessions_left(client: AsyncAgentClient) -> list:
    await client.stats()  # a late SessionOpened is read meanwhile: its close goes before the next request
    return decode_snapshot(await client.stats()).sessions


def test_a_session_cancelled_while_opening_is_closed_once_open(server):
    async def main():
        async with AsyncAgentClient(server.endpoint) as client:
            sent, real = asyncio.Event(), client._send

            async def send(msg, expect_reply=True):
                await real(msg, expect_reply)
                if isinstance(msg, OpenSession):
                    sent.set()

            client._send = send
            opening = asyncio.create_task(client.session(name="cancelled"))
            await sent.wait()
            opening.cancel()
            with pytest.raises(asyncio.CancelledError):
                await opening
            return await _sessions_left(client)

    assert run(main()) == []


@pytest.mark.parametrize("answered", [False, True], ids=["late", "arrived"])
def test_a_session_whose_opening_timed_out_is_closed_once_open(server, answered):
    """A timeout gives the opening up as a cancellation does: the server opened it all the same."""

    async def main():
        async with AsyncAgentClient(server.endpoint) as client:
            real = client._recv

            async def timed_out(req: int, timeout: float):
                if answered:  # its SessionOpened is in, not yet returned
                    client._queues[req].put_nowait(await real(req, timeout))
                raise client._link.silent(timeout, req)

            client._recv = timed_out
            with pytest.raises(ServerUnavailable):
                await client.session(name="timed-out")
            client._recv = real
            return await _sessions_left(client)

    assert run(main()) == []
