"""Hostile frames and fields: every one gets exactly one typed error, nothing escapes the codec, and a
client that stops reading is dropped within the stall bound."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peer_helpers import reply

from agentserve.orchestrator.ingress import ClientGone, Ingress
from agentserve.orchestrator.limits import ClientRules, HangRule, ServingLimits, load_limits
from agentserve.protocol.client_messages import (
    PROTOCOL_VERSION,
    ClientCodec,
    Error,
    ErrorCode,
    Hello,
    Message,
    OpenSession,
    ProtocolError,
    ServerCodec,
    SessionOptions,
    TokenEvent,
    Turn,
    Welcome,
    peek_head,
)
from agentserve.protocol.limits import Limits, check_limits, nesting

ROOT = Path(__file__).resolve().parents[2]
client_codec = ClientCodec()
SERVER_CODEC = ServerCodec()
LIMITS = Limits(max_frame_bytes=64 * 1024, max_tool_bytes=4096, max_text_bytes=2048, max_stop_strings=4)

# ---- the codec: deep, wide and random msgpack ----------------------------------------------------


def _nested(depth: int, kind: str) -> bytes:
    """A value ``depth`` containers deep: ``[[[...nil]]]`` or ``{"a": {"a": ... nil}}``."""
    return (b"\x91" * depth if kind == "array" else b"\x81\xa1a" * depth) + b"\xc0"


MSGPACK_HEADS = [b"\x91", b"\x92", b"\x9f", b"\xdc\x00\x02", b"\x81", b"\xde\x00\x01", b"\xa4turn", b"\xa4open",
                 b"\xa5hello", b"\x01", b"\xcd\x01\x00", b"\xc0", b"\xc3", b"\xd9\x03abc", b"\xdd\xff\xff\xff\xff"]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    head=st.sampled_from([b"", b"\x92\xa4turn\x05", b"\x93\xa4open\x07\x01", b"\x93\xa5hello\x02\x01"]),
    body=st.lists(st.sampled_from(MSGPACK_HEADS), max_size=60).map(b"".join),
    depth=st.integers(0, 6000),
    kind=st.sampled_from(["array", "map"]),
    tail=st.binary(max_size=32),
)
def test_no_frame_makes_the_codec_raise_anything_but_a_protocol_error(head, body, depth, kind, tail):
    data = head + body + _nested(depth, kind) + tail
    for codec in (ServerCodec(), ServerCodec(LIMITS.max_frame_bytes)):
        try:
            codec.decode(data)
        except ProtocolError as e:
            assert e.code in (ErrorCode.MALFORMED_FRAME, ErrorCode.UNKNOWN_MESSAGE, ErrorCode.LIMIT_EXCEEDED)


@pytest.mark.parametrize("depth", [500, 1200, 5000, 100_000])
@pytest.mark.parametrize("where", ["top", "hello.client", "open.tools"])
def test_deep_nesting_is_a_typed_error_at_any_depth(depth, where):
    nested = _nested(depth, "map" if where == "open.tools" else "array")
    data = {"top": nested, "hello.client": b"\x93\xa5hello\x03\x01" + nested,
            "open.tools": b"\x95\xa4open\x04\x01\xa0\x91" + nested}[where]
    with pytest.raises(ProtocolError) as e:
        msg = ServerCodec().decode(data)
        check_limits(msg, Limits())  # a tool schema the decoder accepted is still over max_nesting
    assert e.value.code in (ErrorCode.MALFORMED_FRAME, ErrorCode.LIMIT_EXCEEDED)


INT64 = st.integers(-(2**63), 2**63 - 1)


@given(tag=st.text(max_size=40), req=st.integers(0, 2**63 - 1), rest=st.lists(INT64, max_size=3))
def test_peek_head_reads_tag_and_req_like_a_full_decode(tag, req, rest):
    assert peek_head(msgspec.msgpack.encode([tag, req, *rest])) == (tag, req)


def test_nesting_counts_containers():
    assert nesting({"a": [1, {"b": []}]}, 64) == 4 and nesting("x", 64) == 0 and nesting([], 64) == 1
    deep: list = []
    for _ in range(10_000):
        deep = [deep]
    assert nesting(deep, 64) == 65  # stops counting just past the bound


# ---- field limits --------------------------------------------------------------------------------


def _turn(**kw) -> Turn:
    return Turn(req=3, session=1, **({"token_ids": [1]} | kw))


def _deep(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


OVER = {
    "max_stop_strings": _turn(stop=["x"] * 5),
    "max_stop_bytes": _turn(stop=["x" * 257]),
    "max_messages": Turn(req=3, session=1, messages=[Message("user", "x")] * 4097),
    "max_text_bytes": Turn(req=3, session=1, messages=[Message("user", "é" * 1025)]),
    "tool-call max_text_bytes": Turn(req=3, session=1, messages=[Message("assistant", "", tool_calls=[
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": "y" * 2048}}}])]),
    "tool-call max_nesting": Turn(req=3, session=1, messages=[Message("assistant", "", tool_calls=[
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": _deep(64)}}}])]),
    "max_name_bytes": Turn(req=3, session=1, messages=[Message("tool", "x", tool_call_id="c" * 300)]),
    "max_token_ids": _turn(token_ids=[1] * (2**20 + 1)),
    "max_tools": OpenSession(req=3, version=PROTOCOL_VERSION, tools=[{}] * 257),
    "max_system_bytes": OpenSession(req=3, version=PROTOCOL_VERSION, system="s" * (2**20 + 1)),
    "session max_name_bytes": OpenSession(req=3, version=PROTOCOL_VERSION, options=SessionOptions(name="n" * 300)),
    "client max_name_bytes": Hello(req=3, version=PROTOCOL_VERSION, client="c" * 300),
}


@pytest.mark.parametrize("case", sorted(OVER))
def test_each_field_over_its_limit_gets_limit_exceeded_naming_it(case):
    with pytest.raises(ProtocolError) as e:
        check_limits(OVER[case], LIMITS)
    assert e.value.code is ErrorCode.LIMIT_EXCEEDED and e.value.req == 3
    assert f"limits.request.{case.split()[-1]}" in str(e.value)


# the OpenAI request field each limit bounds, the error's param (a session or client name is no request field)
OVER_PARAM = {"max_stop_strings": "stop", "max_stop_bytes": "stop", "max_messages": "messages",
              "max_text_bytes": "messages", "tool-call max_text_bytes": "messages", "tool-call max_nesting": "messages",
              "max_name_bytes": "messages", "max_token_ids": "prompt", "max_tools": "tools",
              "max_system_bytes": "messages", "session max_name_bytes": "", "client max_name_bytes": ""}


@pytest.mark.parametrize("case", sorted(OVER))
def test_a_limit_names_the_request_field_it_bounds(case):
    with pytest.raises(ProtocolError) as e:
        check_limits(OVER[case], LIMITS)
    assert e.value.param == OVER_PARAM[case] and e.value.to_event().param == OVER_PARAM[case]


def test_tool_schema_bytes_over_the_limit_name_tools():
    with pytest.raises(ProtocolError, match="max_tool_bytes") as e:
        check_limits(OpenSession(req=3, version=PROTOCOL_VERSION, tools=[{}]), LIMITS, encoded_tools=4097)
    assert e.value.param == "tools"


@pytest.mark.parametrize("value", [msgspec.msgpack.Ext(1, b"x"), {None: 1}, {(1, 2): 3}, 2**64 - 1])
def test_any_value_in_tool_calls_is_measured_without_raising(value):
    """A decoded frame may hold values JSON cannot encode: measuring a turn's text once raised TypeError out of the
    ingress, which stopped the server."""
    frame = msgspec.msgpack.encode(["turn", 3, 1, [["assistant", "", "", "", [{"id": "c", "x": value}]]]])
    msg = SERVER_CODEC.decode(frame)
    check_limits(msg, LIMITS)  # within the limits: no error at all


def test_requests_within_the_limits_pass():
    check_limits(_turn(stop=["a", "b"]), LIMITS)
    check_limits(Turn(req=1, session=1, messages=[Message("user", "x" * 2048)]), LIMITS)
    check_limits(OpenSession(req=1, version=1, tools=[{"type": "function"}] * 3), LIMITS)


def test_packaged_limits_file_and_the_defaults_agree(tmp_path):
    data = tomllib.loads((ROOT / "configs" / "limits.toml").read_text())
    assert data["request"] == dataclasses.asdict(Limits())
    assert data["clients"] == dataclasses.asdict(ClientRules())
    assert data["executor"] == dataclasses.asdict(HangRule())
    assert load_limits(environ={}) == ServingLimits()
    user = tmp_path / "mine.toml"
    user.write_text("[request]\nmax_stop_strings = 2\n[engine]\nmodel = 'x'\n")
    assert load_limits(user, environ={"AGENTSERVE_CLIENTS_STALL_TIMEOUT_S": "1.5"}) == ServingLimits(
        Limits(max_stop_strings=2), ClientRules(stall_timeout_s=1.5)
    )


# ---- through the ingress ------------------------------------------------------------------------


RULES = ClientRules(probe_interval_s=0.05, heartbeat_ms=200, heartbeat_timeout_ms=600, stall_timeout_s=1.0,
                    send_hwm=16)


@pytest.fixture
def ingress(request, tmp_path):
    rules = getattr(request, "param", RULES)
    with Ingress(f"ipc://{tmp_path}/in.sock", info=Welcome(0, PROTOCOL_VERSION), limits=LIMITS, rules=rules) as ing:
        yield ing


HOSTILE = {
    "deep array": b"\x91" * 1200 + b"\xc0",
    "deep hello.client": b"\x93\xa5hello\x03\x01" + _nested(3000, "array"),
    "deep open.tools": b"\x95\xa4open\x04\x01\xa0\x91" + _nested(5000, "map"),
    "tools nested past max_nesting": b"\x95\xa4open\x05\x01\xa0\x91" + _nested(100, "map"),
    "oversized frame": msgspec.msgpack.encode(["turn", 6, 1, [], list(range(40000))]),
    "stop flood": client_codec.encode(_turn(stop=[str(i) for i in range(1000)])),
    "too much text": client_codec.encode(Turn(req=8, session=1, messages=[Message("user", "x" * 5000)])),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_frame_gets_one_typed_error_and_the_ingress_keeps_serving(ingress, peer, case):
    peer.send(HOSTILE[case])
    err = reply(ingress, peer)
    assert isinstance(err, Error) and err.code in (ErrorCode.MALFORMED_FRAME, ErrorCode.LIMIT_EXCEEDED), err
    assert not peer.poll(100), "exactly one reply"
    peer.send(client_codec.encode(Hello(req=99, version=PROTOCOL_VERSION)))
    assert isinstance(reply(ingress, peer), Welcome)


_FROZEN_CLIENT = (
    "import sys, zmq, time\n"
    "s = zmq.Context().socket(zmq.DEALER); s.connect(sys.argv[1]); s.send(b'')\n"
    "while True: s.recv()\n"
)


def _frozen_client(ingress) -> tuple[subprocess.Popen, bytes]:
    proc = subprocess.Popen([sys.executable, "-c", _FROZEN_CLIENT, ingress.endpoint])
    deadline = time.monotonic() + 20
    while not ingress.clients and time.monotonic() < deadline:
        ingress.poll(20)
    (cid,) = ingress.clients
    os.kill(proc.pid, signal.SIGSTOP)
    return proc, cid


def test_a_frame_far_over_the_bound_drops_only_its_connection(ingress, peer, tmp_path):
    """Beyond 4x ``max_frame_bytes`` libzmq refuses to buffer the frame and closes that connection; the
    ingress serves everyone else."""
    other = zmq.Context.instance().socket(zmq.DEALER)
    other.setsockopt(zmq.LINGER, 0)
    other.connect(ingress.endpoint)
    try:
        peer.send(client_codec.encode(_turn(stop=[str(i) for i in range(250_000)])))
        time.sleep(0.2)
        other.send(client_codec.encode(Hello(req=5, version=PROTOCOL_VERSION)))
        assert isinstance(reply(ingress, other), Welcome)
    finally:
        other.close()


# heartbeats far off: the stall rule alone must catch the frozen reader
NO_HEARTBEAT = dataclasses.replace(RULES, heartbeat_ms=10_000, heartbeat_timeout_ms=60_000, probe_interval_s=30.0)


@pytest.mark.parametrize("ingress", [NO_HEARTBEAT], indirect=True)
def test_a_client_that_stops_reading_mid_stream_is_dropped_within_the_stall_bound(ingress):
    """3,000 token events for a SIGSTOPped client: ZeroMQ takes a few, the rest wait in the backlog, which
    makes no progress; the client is reported gone as ``stalled`` about ``stall_timeout_s`` later."""
    proc, cid = _frozen_client(ingress)
    try:
        event = TokenEvent(req=1, session=1, token_ids=[65], text="A", t_mono=1.0, t_wall=1.0)
        t0 = time.monotonic()
        gone: list = []
        for _ in range(3000):
            ingress.send(cid, event)
            gone += ingress.poll(1)
            if gone:
                break
        while not gone and time.monotonic() - t0 < 20:
            gone += ingress.poll(20)
        elapsed = time.monotonic() - t0
        assert gone == [(cid, ClientGone("stalled"))]
        assert elapsed < 1.0 + 5.0, f"dropped after {elapsed:.1f} s (stall timeout 1 s)"
        assert ingress.backlogged == 0 and cid not in ingress.clients
        assert ingress.counters["clients_stalled"] == 1
    finally:
        proc.kill()
        proc.wait()


def test_a_slow_reader_keeps_every_event_in_order(ingress, peer):
    """Events beyond ZeroMQ's queue wait in the backlog and all arrive, in order, once the client reads."""
    peer.send(b"")
    deadline = time.monotonic() + 5
    while not ingress.clients and time.monotonic() < deadline:
        ingress.poll(10)
    (cid,) = ingress.clients
    for i in range(2000):
        assert ingress.send(cid, TokenEvent(req=1, session=1, token_ids=[i]))
    assert ingress.backlogged > 0, "the test must overflow ZeroMQ's queue"
    got: list[int] = []
    deadline = time.monotonic() + 10
    while len(got) < 2000 and time.monotonic() < deadline:
        ingress.poll(1)
        while peer.poll(0):
            payload = peer.recv()
            if payload:
                got += client_codec.decode(payload).token_ids
    assert got == list(range(2000)) and ingress.backlogged == 0
    assert cid in ingress.clients


def test_a_request_a_check_cannot_measure_is_that_clients_error(ingress, peer, monkeypatch):
    """Whatever a check raises on a strange value is answered to that client, never raised out of the loop."""
    import agentserve.orchestrator.ingress as ingress_module

    def broken(msg, limits, encoded_tools=0):
        raise TypeError("a value no check foresaw")

    monkeypatch.setattr(ingress_module, "check_limits", broken)
    peer.send(client_codec.encode(_turn()))
    err = reply(ingress, peer)
    assert isinstance(err, Error) and err.code is ErrorCode.INVALID_REQUEST and "foresaw" in err.message, err
    monkeypatch.undo()
    peer.send(client_codec.encode(Hello(req=99, version=PROTOCOL_VERSION)))
    assert isinstance(reply(ingress, peer), Welcome)
