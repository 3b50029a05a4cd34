"""The sync SDK against the echo server (real Ingress, real ZMQ sockets on ipc:// paths)."""

from __future__ import annotations

import time

import pytest
from agent_fake_server import EchoServer, recording_sends

from agentserve.client import (
    AgentClient,
    Done,
    InvalidRequest,
    InvalidSampling,
    PromptTooLong,
    ServerDisconnected,
    ServerShutdown,
    ServerUnavailable,
    TextDelta,
    TokenIds,
    ToolCall,
    TurnInProgress,
    UnknownSession,
)
from agentserve.protocol.client_messages import FinishReason
from agentserve.protocol.stats import decode_snapshot


def test_handshake_reports_server_info(server):
    with AgentClient(server.endpoint) as client:
        assert client.server.model == "echo"
        assert client.server.run == "fake-run"
        assert client.server.version == 1


def test_text_turn_streams_deltas_token_ids_and_done(server):
    with AgentClient(server.endpoint) as client, client.session(system="be brief", name="a") as s:
        assert s.prompt_tokens == len(b"be brief")
        events = list(s.turn("hello"))
    ids = [t for e in events if isinstance(e, TokenIds) for t in e.token_ids]
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert ids == list(b"hello") and text == "hello"
    done = events[-1]
    assert isinstance(done, Done) and done.finish is FinishReason.STOP
    assert done.usage.completion_tokens == 5
    assert done.usage.prompt_tokens == 5 and done.usage.cached_tokens == len(b"be brief")
    assert done.timings.e2e_ms >= done.timings.ttft_ms > 0
    assert all(e.t_wall > 0 for e in events if isinstance(e, TokenIds))


def test_raw_token_mode_with_ignore_eos_runs_to_max_tokens(server):
    with AgentClient(server.endpoint) as client, client.session() as s:
        res = s.turn(token_ids=[7, 8, 9], ignore_eos=True, max_tokens=8).collect()
    assert res.token_ids == [7, 8, 9, 7, 8, 9, 7, 8]
    assert res.finish is FinishReason.LENGTH


def test_tool_call_then_tool_result_goes_out_with_the_next_turn(server):
    with AgentClient(server.endpoint) as client, client.session(tools=[{"type": "function"}]) as s:
        first = s.turn("CALL 2+3").collect()
        assert first.finish is FinishReason.TOOL_CALLS
        (call,) = first.tool_calls
        assert isinstance(call, ToolCall) and call.name == "calc" and call.arguments == {"expr": "2+3"}
        s.tool_result(call.id, "5")
        second = s.turn().collect()
    assert second.text == "5"
    sent = server.turn_requests[-1]
    assert [(m.role, m.content, m.tool_call_id) for m in sent.messages] == [("tool", "5", call.id)]
    assert second.usage.cached_tokens > first.usage.cached_tokens  # the context grew on the server


def test_openai_shaped_messages_keep_their_tool_calls_and_results_go_as_json(server):
    """A dict message's ``tool_calls`` were dropped (and a null content sent as ""), so an OpenAI-style history
    rendered without its calls; a non-str tool result went as Python's repr (``{'t': 20}``), which is no JSON."""
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                   "name": "get", "arguments": '{"city": "Rome"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    with AgentClient(server.endpoint) as client, client.session() as s:
        s.turn(history + [{"role": "user", "content": "ok"}]).collect()
        s.tool_result("c2", {"t": 20, "ok": True, "place": "Zürich"})
        s.turn("x").collect()
    first, second = server.turn_requests[-2:]
    assert first.messages[1].tool_calls == [{"id": "c1", "type": "function",
                                             "function": {"name": "get", "arguments": {"city": "Rome"}}}]
    assert second.messages[0].content == '{"t": 20, "ok": true, "place": "Zürich"}'


def test_interleaved_sessions_on_one_client_get_their_own_events(server):
    with AgentClient(server.endpoint) as client:
        a, b = client.session(), client.session()
        sa, sb = a.turn("aaaa"), b.turn("bbbbbbbb")
        assert sb.collect().text == "bbbbbbbb"
        assert sa.collect().text == "aaaa"


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"temperature": -1.0}, InvalidSampling),
        ({"top_p": 0.0}, InvalidSampling),
        ({"max_tokens": 0}, InvalidSampling),
        ({"stop": [""]}, InvalidSampling),
        ({"token_ids": [1, 2]}, InvalidRequest),  # and messages: both given
        ({"max_tokens": 100_000}, PromptTooLong),
    ],
)
def test_bad_turns_raise_typed_errors_and_the_session_still_works(server, kwargs, error):
    with AgentClient(server.endpoint) as client, client.session() as s:
        with pytest.raises(error):
            s.turn("hi", **kwargs).collect()
        assert s.turn("ok").collect().text == "ok"


def test_an_integer_past_64_bits_is_a_typed_error_and_the_session_goes_on(server):
    """msgpack's OverflowError escaped the SDK, untyped."""
    with AgentClient(server.endpoint) as client, client.session() as s:
        with pytest.raises(InvalidRequest, match="does not fit in 64 bits"):
            s.turn("hi", seed=2**64)
        assert s.turn("ok").collect().text == "ok"


def test_second_turn_while_one_runs_is_turn_in_progress(slow_server):
    with AgentClient(slow_server.endpoint) as client:
        s = client.session()
        running = s.turn("x" * 40)
        next(iter(running))
        # bypass Session.turn (it would abort the running turn first): send a raw second turn
        req = client._next_req()
        client._send(s._state.new_turn(req, "again"))
        from agentserve.client.sync import TurnStream

        with pytest.raises(TurnInProgress):
            TurnStream(s, req).collect()
        assert running.collect().text == "x" * 40


def test_unknown_and_foreign_sessions_are_rejected(server):
    with AgentClient(server.endpoint) as owner, AgentClient(server.endpoint) as other:
        s = owner.session()
        foreign = other.session()
        foreign.id = s.id  # another connection's session id
        foreign._state.id = s.id
        with pytest.raises(UnknownSession):
            foreign.turn("steal").collect()
        assert s.turn("mine").collect().text == "mine"


def test_abort_ends_the_stream_with_finish_abort(slow_server):
    with AgentClient(slow_server.endpoint) as client, client.session() as s:
        stream = s.turn("y" * 200)
        got = []
        for ev in stream:
            got.append(ev)
            if len(got) == 3:
                stream.abort()
        assert stream.result.finish is FinishReason.ABORT
        assert 0 < len(stream.result.token_ids) < 200
        assert s.turn("next").collect().text == "next"


def test_breaking_out_then_starting_a_new_turn_aborts_the_old_one(slow_server):
    with AgentClient(slow_server.endpoint) as client, client.session() as s:
        for _ in s.turn("z" * 200):
            break
        assert s.turn("fresh").collect().text == "fresh"


def test_stats_round_trip(server):
    with AgentClient(server.endpoint) as client:
        client.session(name="agent-7")
        snap = decode_snapshot(client.stats())
    assert [r.name for r in snap.sessions] == ["agent-7"]


@pytest.mark.parametrize("where", ["nobody.sock", "missing/folder/nobody.sock"])
def test_no_server_is_a_clear_error_not_a_hang(tmp_path, where):
    t0 = time.monotonic()
    with pytest.raises(ServerUnavailable, match="no AgentServe server answered"):
        AgentClient(f"ipc://{tmp_path}/{where}", timeout=0.5)
    assert time.monotonic() - t0 < 5
    assert not (tmp_path / "missing").exists()  # connecting makes no folder


def test_server_death_mid_stream_raises_server_disconnected(endpoint):
    srv = EchoServer(endpoint, token_delay_s=0.02).__enter__()
    with AgentClient(endpoint) as client:
        s = client.session()
        stream = s.turn("w" * 500)
        it = iter(stream)
        next(it)
        srv.stop()
        with pytest.raises(ServerDisconnected):
            for _ in it:
                pass
        assert stream.finished


def test_a_session_of_a_dropped_connection_closes_without_waiting_for_the_server(endpoint, monkeypatch):
    """The server closed it with the connection: leaving ``with session`` after ``ServerDisconnected`` sends no
    close (it used to wait out ``timeout`` for a dead server before the caller saw the error)."""
    srv = EchoServer(endpoint, token_delay_s=0.02).__enter__()
    with AgentClient(endpoint, timeout=20) as client:
        sent = []
        recording = recording_sends(client, sent)

        with pytest.raises(ServerDisconnected), client.session() as s:
            it = iter(s.turn("w" * 500))
            next(it)
            srv.stop()
            monkeypatch.setattr(client, "_send", recording)
            for _ in it:
                pass
        assert sent == []
        s.close()  # and again: nothing to do
        assert sent == []


def test_after_server_shutdown_a_session_closes_at_once_and_new_requests_are_refused(endpoint):
    """A stopping server ends its turns with ``server_shutdown`` and answers nothing more, though its socket stays
    open until its executor has stopped: leaving ``with session`` then sends no close (it waited out ``timeout``),
    and a new request is refused at once instead of timing out."""
    with EchoServer(endpoint, token_delay_s=0.02) as srv, AgentClient(endpoint, timeout=20) as client:
        sent = []
        recording = recording_sends(client, sent)

        t0 = time.monotonic()
        with pytest.raises(ServerShutdown), client.session() as s:
            client._send = recording
            it = iter(s.turn("w" * 500))
            next(it)
            srv.shut_down()
            for _ in it:
                pass
        assert sent == ["Turn"]
        with pytest.raises(ServerShutdown):
            client.session()
        assert time.monotonic() - t0 < 10  # far from the 20 s timeout either would have waited out


@pytest.mark.parametrize("closed", ["turn", "session"])
def test_closing_after_a_drop_sends_nothing_and_ends_the_turn(endpoint, monkeypatch, closed):
    """Once the client knows the connection dropped, the server ended the turn with it: ``close`` of the turn
    (``with stream``) sends no abort to the dead server (it waited out ``timeout`` for the socket to take one), and
    ``close`` of its session ends the unread turn (it returned before, leaving the turn's routing entry behind and
    its stream unfinished)."""
    srv = EchoServer(endpoint, token_delay_s=0.02).__enter__()
    with AgentClient(endpoint, timeout=20) as client:
        s = client.session()
        stream = s.turn("w" * 500)
        next(iter(stream))
        srv.stop()
        deadline = time.monotonic() + 30
        while client._link.epoch == 0 and time.monotonic() < deadline:  # the drop, as the monitor reports it
            client._drain_monitor()
            time.sleep(0.01)
        sent = []
        recording = recording_sends(client, sent)

        monkeypatch.setattr(client, "_send", recording)
        (stream if closed == "turn" else s).close()
        assert sent == [] and stream.finished
        assert stream.req not in client._inbox and stream.req not in client._sent_epoch


def test_a_turn_given_up_on_the_client_lets_the_sessions_next_turn_start(endpoint):
    """A stream given up here (a timeout, Ctrl-C) sends an abort; the turn runs on the server until that is done, and
    a next turn sent at once was refused as still in progress (6 times in 10): it now waits for the turn's end."""
    with EchoServer(endpoint, token_delay_s=0.2, lazy_abort=True) as srv, \
            AgentClient(endpoint, event_timeout=0.05) as client, client.session() as s:
        for _ in range(3):
            with pytest.raises(ServerUnavailable):
                s.turn("w" * 50).collect()
            assert srv.gens  # still running there when the next turn is sent
        client.event_timeout = 10
        assert s.turn("ok").collect().text == "ok"
    assert not client._inbox  # every given-up turn's events unrouted once it ended


def test_client_disconnect_aborts_its_turns_on_the_server(slow_server):
    client = AgentClient(slow_server.endpoint)
    s = client.session()
    stream = s.turn("v" * 500)
    next(iter(stream))
    client.close()
    deadline = time.monotonic() + 5
    while not slow_server.aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert slow_server.aborted == [stream.req]
    assert len(slow_server.table) == 0  # its sessions are gone too


@pytest.mark.parametrize("answered", [False, True], ids=["late", "arrived"])
@pytest.mark.parametrize("error", [KeyboardInterrupt, ServerUnavailable])
def test_a_session_given_up_while_opening_is_closed_once_open(server, monkeypatch, error, answered):
    """The server opens a session whatever became of the request: one whose ``opened`` the caller stopped waiting
    for (Ctrl-C, a timeout) is closed, at once if it had arrived, else when the client next reads it."""
    with AgentClient(server.endpoint) as client:
        real = client._recv

        def given_up(req: int, timeout: float):
            if answered:  # its SessionOpened is in, not yet returned
                client._inbox[req].append(real(req, timeout))
            raise error("given up")

        monkeypatch.setattr(client, "_recv", given_up)
        with pytest.raises(error):
            client.session(name="given-up")
        monkeypatch.undo()
        client.stats()  # its SessionOpened, if late, is read meanwhile: the close goes before the next request
        assert decode_snapshot(client.stats()).sessions == []
        assert client.session(name="kept").turn("ok").collect().text == "ok"


def test_opens_given_up_on_a_dropped_connection_are_forgotten() -> None:
    """Their answers never come (the server closed the lost connection's sessions): no entry per give-up for good."""
    import zmq

    from agentserve.client.transport import ClientBase
    from agentserve.protocol.client_messages import OpenSession

    client = ClientBase(zmq.Context(), "ipc:///tmp/agentserve-test-unused.sock", 1.0, 1.0, 1000)
    try:
        client._give_up(OpenSession(req=1, version=1), [])
        client._give_up(OpenSession(req=2, version=1), [])
        assert client._given_up_opens == {1, 2}
        client._link.epoch += 1  # the connection dropped
        client._give_up(OpenSession(req=3, version=1), [])
        assert client._given_up_opens == {3}
    finally:
        client._close_sockets()


def test_an_error_code_this_sdk_does_not_know_is_still_its_requests_error() -> None:
    """A newer server's error code: the request fails at once with a plain AgentServeError naming the code, instead
    of an undecodable frame that leaves it waiting for its timeout; other undecodable frames stay violations."""
    import msgspec

    from agentserve.client import AgentServeError, ProtocolViolation
    from agentserve.client.errors import from_event
    from agentserve.client.transport import Link
    from agentserve.protocol.client_messages import Error

    link = Link("ipc:///unused")
    event = link.decode(msgspec.msgpack.encode(["error", 7, "some_future_code", "try later", 3]))
    assert isinstance(event, Error) and (event.req, event.session) == (7, 3)
    error = from_event(event)
    assert type(error) is AgentServeError and str(error) == "some_future_code: try later" and error.req == 7
    assert error.param == ""
    event = link.decode(msgspec.msgpack.encode(["error", 8, "some_future_code", "too hot", 3, "temperature"]))
    assert isinstance(event, Error) and (event.req, event.session, event.param) == (8, 3, "temperature")
    assert from_event(event).param == "temperature"
    event = link.decode(msgspec.msgpack.encode(["error", 9, "some_future_code", "x", 3, "stop", "a later field", 1]))
    assert isinstance(event, Error) and (event.req, event.param) == (9, "stop")  # trailing fields of a later server
    with pytest.raises(ProtocolViolation):
        link.decode(msgspec.msgpack.encode(["error", "not a req", "some_future_code", "x"]))
    with pytest.raises(ProtocolViolation):
        link.decode(msgspec.msgpack.encode(["no_such_event", 7]))


def test_an_error_names_the_request_field_the_server_blamed() -> None:
    from agentserve.client import InvalidSampling, LimitExceeded
    from agentserve.client.errors import from_event
    from agentserve.protocol.client_messages import Error, ErrorCode

    error = from_event(Error(4, ErrorCode.INVALID_SAMPLING, "top_p must be in (0, 1], got 0.0", 2, "top_p"))
    assert isinstance(error, InvalidSampling) and (error.req, error.session, error.param) == (4, 2, "top_p")
    error = from_event(Error(5, ErrorCode.LIMIT_EXCEEDED, "stop strings: 17 exceeds the limit of 16", 2, "stop"))
    assert isinstance(error, LimitExceeded) and error.param == "stop"
    assert from_event(Error(6, ErrorCode.BUSY, "retry")).param == ""


@pytest.mark.parametrize("endpoint", ["bogus", "http://127.0.0.1:8000", "ipc://relative/path", "tcp://host-without-port"])
def test_an_endpoint_no_client_can_connect_to_is_a_typed_error(endpoint) -> None:
    """Before: zmq's own ZMQError (or an 'Invalid argument' from libzmq), not an AgentServeError."""
    import asyncio

    from agentserve.client import AgentServeError, AsyncAgentClient, InvalidEndpoint

    for make in (lambda: AgentClient(endpoint, timeout=0.2), lambda: asyncio.run(AsyncAgentClient(endpoint).connect())):
        with pytest.raises(InvalidEndpoint) as e:
            make()
        assert isinstance(e.value, AgentServeError) and endpoint in str(e.value)


def test_timeouts_must_be_positive() -> None:
    with pytest.raises(ValueError, match="timeouts must be > 0"):
        AgentClient("ipc:///tmp/agentserve-unused.sock", timeout=-1)
