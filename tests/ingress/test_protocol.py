"""Wire protocol codec, validation, and the client/session table."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentserve.orchestrator.session_table import SessionTable
from agentserve.protocol.client_messages import (
    CLIENT_TAGS,
    PROTOCOL_VERSION,
    SERVER_TAGS,
    Abort,
    ClientCodec,
    CloseSession,
    Error,
    ErrorCode,
    FinishReason,
    GetStats,
    Hello,
    Message,
    OpenSession,
    ProtocolError,
    ServerCodec,
    SessionClosed,
    SessionOpened,
    SessionOptions,
    StatsReply,
    Timings,
    TokenEvent,
    ToolCallEvent,
    Turn,
    TurnDone,
    Usage,
    Welcome,
    validate,
)

REQUESTS = [
    Hello(1, PROTOCOL_VERSION, "c"),
    OpenSession(2, PROTOCOL_VERSION, "sys", [{"type": "function", "function": {"name": "f"}}], SessionOptions("n")),
    Turn(
        3,
        1,
        [Message("user", "hi"), Message("tool", "5", "call_1")],
        max_tokens=9,
        top_k=4,
        seed=7,
        stop=["\n"],
    ),
    Turn(4, 1, token_ids=[1, 2, 3], ignore_eos=True),
    Abort(5, 1, 3),
    CloseSession(6, 1),
    GetStats(7),
]
EVENTS = [
    Welcome(1, PROTOCOL_VERSION, "0.1", "m", 4096, "run", 123),
    SessionOpened(2, 1, 321),
    TokenEvent(3, 1, [5, 6], "ab", 1.5, 1.7e9),
    ToolCallEvent(3, 1, "call_1", "calc", {"expr": "1+1", "nested": {"k": [1, 2]}}),
    TurnDone(3, 1, FinishReason.TOOL_CALLS, Usage(10, 4, 2), Timings(1.0, 2.0, 3.0, 4.0)),
    SessionClosed(6, 1),
    StatsReply(7, b"\x80"),
    Error(0, ErrorCode.MALFORMED_FRAME, "bad"),
    Error(3, ErrorCode.INVALID_SAMPLING, "temperature must be >= 0, got -1.0", 1, "temperature"),
]


@pytest.mark.parametrize("msg", REQUESTS, ids=lambda m: type(m).__name__)
def test_requests_round_trip_and_validate(msg):
    back = ServerCodec().decode(ClientCodec().encode(msg))
    assert back == msg
    validate(back)


@pytest.mark.parametrize("ev", EVENTS, ids=lambda m: type(m).__name__)
def test_events_round_trip(ev):
    assert ClientCodec().decode(ServerCodec().encode(ev)) == ev


class ErrorBeforeParam(msgspec.Struct, tag="error", array_like=True, omit_defaults=True):
    """``Error`` as it was before ``param`` (a trailing field) was added: what an older peer reads and writes."""

    req: int
    code: str
    message: str
    session: int = 0


def test_error_param_is_a_trailing_field_older_peers_read_and_write():
    """``param`` travels as the last element of the array, so an older reader takes the rest and ignores it, with
    or without a param; an older writer's error (one element shorter) reads as ``param=""``."""
    codec = ServerCodec()
    blamed = ProtocolError(ErrorCode.INVALID_SAMPLING, "top_p must be in (0, 1], got 0.0", 3, 1, "top_p").to_event()
    assert ClientCodec().decode(codec.encode(blamed)).param == "top_p"
    for event in (blamed, Error(4, ErrorCode.BUSY, "retry", 2)):
        old = msgspec.msgpack.decode(codec.encode(event), type=ErrorBeforeParam)
        assert (old.req, old.code, old.message, old.session) == (event.req, event.code.value, event.message,
                                                                 event.session)
    back = ClientCodec().decode(msgspec.msgpack.encode(ErrorBeforeParam(5, "limit_exceeded", "too many")))
    assert back == Error(5, ErrorCode.LIMIT_EXCEEDED, "too many") and back.param == ""


@pytest.mark.parametrize(
    ("turn", "param"),
    [
        (Turn(1, 1, token_ids=[1], temperature=-1.0), "temperature"),
        (Turn(1, 1, token_ids=[1], top_k=-2), "top_k"),
        (Turn(1, 1, token_ids=[1], top_p=1.5), "top_p"),
        (Turn(1, 1, token_ids=[1], min_p=-0.1), "min_p"),
        (Turn(1, 1, token_ids=[1], max_tokens=0), "max_tokens"),
        (Turn(1, 1, token_ids=[1], seed=2**63), "seed"),
        (Turn(1, 1, token_ids=[1], logprobs=True, top_logprobs=21), "top_logprobs"),
        (Turn(1, 1, token_ids=[1], top_logprobs=2), "top_logprobs"),
        (Turn(1, 1, token_ids=[1], stop=[""]), "stop"),
        (Turn(1, 1, token_ids=[-1]), "prompt"),
        (Turn(1, 1, messages=[Message("wizard", "x")]), "messages"),
        (Turn(1, 1), ""),  # neither messages nor token ids: no one field is at fault
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_a_refused_turn_names_the_field_at_fault(turn, param):
    with pytest.raises(ProtocolError) as e:
        validate(turn)
    assert e.value.param == param and e.value.to_event().param == param


def test_tags_are_disjoint_so_a_confused_peer_gets_unknown_message():
    assert not CLIENT_TAGS & SERVER_TAGS


def test_turn_maps_to_ring_sampling_params():
    sp = Turn(1, 1, token_ids=[1], temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=3, max_tokens=11,
              ignore_eos=True).sampling_params([2])  # fmt: skip
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.seed, sp.max_tokens) == (0.7, 0.9, 5, 0.1, 3, 11)
    assert sp.ignore_eos and sp.stop_token_ids == [2]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_any_bytes_decode_or_raise_a_protocol_error(data):
    codec = ServerCodec()
    try:
        validate(codec.decode(data))
    except ProtocolError as e:
        assert isinstance(e.code, ErrorCode)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.integers(-(2**63), 2**64 - 1), st.text(max_size=5), st.none(), st.booleans()), max_size=6))
def test_arrays_with_a_request_tag_never_escape_as_other_exceptions(fields):
    import msgspec

    for tag in sorted(CLIENT_TAGS):
        try:
            validate(ServerCodec().decode(msgspec.msgpack.encode([tag, *fields])))
        except ProtocolError as e:
            assert e.code is not ErrorCode.UNKNOWN_MESSAGE


# ---- SessionTable ---------------------------------------------------------------------------------


@dataclass
class Rec:
    session: int
    client: bytes
    running_req: int = 0


def _open(t: SessionTable[Rec], client: bytes) -> Rec:
    return t.add(Rec(t.new_id(), client))


def test_sessions_belong_to_their_client():
    t: SessionTable[Rec] = SessionTable()
    a = _open(t, b"A")
    with pytest.raises(ProtocolError) as e:
        t.owned(b"B", a.session, req=3)
    assert e.value.code is ErrorCode.UNKNOWN_SESSION and e.value.req == 3
    with pytest.raises(ProtocolError):
        t.owned(b"A", 999)
    assert t.owned(b"A", a.session) is a


def test_one_turn_at_a_time_per_session():
    t: SessionTable[Rec] = SessionTable()
    s = _open(t, b"A")
    t.idle(b"A", s.session, 10).running_req = 10
    with pytest.raises(ProtocolError) as e:
        t.idle(b"A", s.session, 11)
    assert e.value.code is ErrorCode.TURN_IN_PROGRESS and e.value.req == 11
    s.running_req = 0
    assert t.idle(b"A", s.session, 12) is s


def test_a_gone_client_takes_exactly_its_sessions():
    t: SessionTable[Rec] = SessionTable()
    a1, a2, b1 = _open(t, b"A"), _open(t, b"A"), _open(t, b"B")
    assert t.of_client(b"A") == [a1, a2]
    for rec in t.of_client(b"A"):
        t.drop(rec)
    assert list(t.values()) == [b1]
    assert t.of_client(b"A") == []
    t.drop(b1)
    assert len(t) == 0 and t.get(b1.session) is None
