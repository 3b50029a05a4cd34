"""The Ingress with raw ZeroMQ peers: bad input → typed errors, disconnects, endpoint rules."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import msgspec
import pytest
from peer_helpers import pump, reply

from agentserve.orchestrator.ingress import ClientGone, Ingress
from agentserve.orchestrator.limits import ClientRules
from agentserve.protocol.client_messages import (
    PROTOCOL_VERSION,
    ClientCodec,
    Error,
    ErrorCode,
    Hello,
    Message,
    OpenSession,
    Turn,
    Welcome,
)
from agentserve.protocol.endpoints import EndpointError, check_bind, check_endpoint, default_endpoint

codec = ClientCodec()


@pytest.fixture
def ingress(tmp_path):
    info = Welcome(0, PROTOCOL_VERSION, model="m", max_model_len=99)
    with Ingress(
        f"ipc://{tmp_path}/in.sock",
        info=info,
        rules=ClientRules(probe_interval_s=0.05, heartbeat_ms=200, heartbeat_timeout_ms=600),
    ) as ing:
        yield ing


def test_hello_is_answered_by_the_ingress_itself(ingress, peer):
    peer.send(codec.encode(Hello(req=4, version=PROTOCOL_VERSION)))
    welcome = reply(ingress, peer)
    assert isinstance(welcome, Welcome) and welcome.req == 4 and welcome.max_model_len == 99


def test_valid_request_reaches_the_caller_with_the_client_id(ingress, peer):
    turn = Turn(req=9, session=3, messages=[Message("user", "hi")], temperature=0.5)
    peer.send(codec.encode(turn))
    (item,) = pump(ingress, lambda got: got)
    cid, msg = item
    assert isinstance(cid, bytes) and msg == turn
    assert cid in ingress.clients


BAD = {
    "not msgpack": (b"\xc1\xc1", ErrorCode.MALFORMED_FRAME, 0),
    "not an array": (msgspec.msgpack.encode({"a": 1}), ErrorCode.MALFORMED_FRAME, 0),
    "unknown tag": (msgspec.msgpack.encode(["teleport", 5]), ErrorCode.UNKNOWN_MESSAGE, 0),
    "server tag": (msgspec.msgpack.encode(["welcome", 5, 1]), ErrorCode.UNKNOWN_MESSAGE, 0),
    "wrong field type": (msgspec.msgpack.encode(["turn", 6, "sess"]), ErrorCode.MALFORMED_FRAME, 6),
    "old version": (codec.encode(OpenSession(req=7, version=0)), ErrorCode.UNSUPPORTED_VERSION, 7),
    "new version": (
        codec.encode(Hello(req=8, version=PROTOCOL_VERSION + 1)),
        ErrorCode.UNSUPPORTED_VERSION,
        8,
    ),
    "empty turn": (codec.encode(Turn(req=10, session=1)), ErrorCode.INVALID_REQUEST, 10),
    "bad role": (
        codec.encode(Turn(req=11, session=1, messages=[Message("wizard", "x")])),
        ErrorCode.INVALID_REQUEST,
        11,
    ),
    "negative token": (codec.encode(Turn(req=12, session=1, token_ids=[-3])), ErrorCode.INVALID_REQUEST, 12),
    "bad min_p": (
        codec.encode(Turn(req=13, session=1, token_ids=[1], min_p=1.5)),
        ErrorCode.INVALID_SAMPLING,
        13,
    ),
    "bad seed": (
        codec.encode(Turn(req=14, session=1, token_ids=[1], seed=-1)),
        ErrorCode.INVALID_SAMPLING,
        14,
    ),
    "top_logprobs without logprobs": (
        codec.encode(Turn(req=15, session=1, token_ids=[1], top_logprobs=2)),
        ErrorCode.INVALID_SAMPLING,
        15,
    ),
    "too many top_logprobs": (
        codec.encode(Turn(req=16, session=1, token_ids=[1], logprobs=True, top_logprobs=21)),
        ErrorCode.INVALID_SAMPLING,
        16,
    ),
    "stop string over its limit": (
        codec.encode(Turn(req=17, session=1, token_ids=[1], stop=["x" * 257])),
        ErrorCode.LIMIT_EXCEEDED,
        17,
    ),
}
# the request field each error names (OpenAI's name: a raw turn's token ids are its `prompt`); "" for the others
PARAM = {"bad role": "messages", "negative token": "prompt", "bad min_p": "min_p", "bad seed": "seed",
         "top_logprobs without logprobs": "top_logprobs", "too many top_logprobs": "top_logprobs",
         "stop string over its limit": "stop"}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_gets_a_typed_error_and_the_ingress_keeps_serving(ingress, peer, case):
    payload, code, req = BAD[case]
    peer.send(payload)
    err = reply(ingress, peer)
    assert isinstance(err, Error) and err.code is code and err.req == req
    assert err.param == PARAM.get(case, "")
    assert ingress.counters[f"error.{code.value}"] == 1
    peer.send(codec.encode(Hello(req=99, version=PROTOCOL_VERSION)))
    assert isinstance(reply(ingress, peer), Welcome)


def test_multipart_frame_is_malformed(ingress, peer):
    peer.send_multipart([b"a", b"b"])
    err = reply(ingress, peer)
    assert err.code is ErrorCode.MALFORMED_FRAME and "frame" in err.message


def test_a_flood_of_garbage_does_not_stop_valid_requests(ingress, peer):
    for i in range(200):
        peer.send(os.urandom(1 + i % 40))
    peer.send(codec.encode(Turn(req=1, session=1, token_ids=[1])))
    got = pump(ingress, lambda got: got)
    assert [type(m) for _, m in got] == [Turn]


def test_killed_client_is_reported_gone_once(ingress):
    code = (
        "import sys, zmq, time\n"
        "s = zmq.Context().socket(zmq.DEALER); s.connect(sys.argv[1])\n"
        "s.send(sys.argv[2].encode('latin1')); time.sleep(60)\n"
    )
    hello = codec.encode(Hello(req=1, version=PROTOCOL_VERSION)).decode("latin1")
    proc = subprocess.Popen([sys.executable, "-c", code, ingress.endpoint, hello])
    try:
        pump(ingress, lambda got: ingress.clients, timeout=20)
        (cid,) = ingress.clients
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        got = pump(ingress, lambda got: got)
        assert got == [(cid, ClientGone())]
        assert pump(ingress, lambda got: got, timeout=0.3) == []  # reported once
        assert ingress.clients == set()
    finally:
        proc.kill()
        proc.wait()


def test_stopped_client_is_reported_gone_by_heartbeat(ingress):
    code = (
        "import sys, zmq, time\ns = zmq.Context().socket(zmq.DEALER); s.connect(sys.argv[1])\n"
        "s.send(b''); time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, ingress.endpoint])
    try:
        pump(ingress, lambda got: ingress.clients, timeout=20)
        (cid,) = ingress.clients
        os.kill(proc.pid, signal.SIGSTOP)  # alive but silent: only heartbeats can tell
        got = pump(ingress, lambda got: got, timeout=10)
        assert got == [(cid, ClientGone())]
    finally:
        proc.kill()
        proc.wait()


def test_send_to_a_gone_client_returns_false(ingress, peer):
    peer.send(codec.encode(Hello(req=1, version=PROTOCOL_VERSION)))
    reply(ingress, peer)
    (cid,) = ingress.clients
    peer.close(linger=0)
    deadline = time.monotonic() + 5
    ok = True
    while ok and time.monotonic() < deadline:
        ok = ingress.send(cid, Error(req=1, code=ErrorCode.INTERNAL, message="x"))
        time.sleep(0.01)
    assert not ok
    assert (cid, ClientGone()) in pump(ingress, lambda got: got)


# ---- endpoints ----------------------------------------------------------------------------------


def test_ipc_socket_file_is_removed_on_close(tmp_path):
    path = tmp_path / "x.sock"
    ing = Ingress(f"ipc://{path}")
    assert path.exists()
    ing.close()
    ing.close()  # idempotent
    assert not path.exists()


def test_stale_socket_file_is_replaced_but_a_live_one_is_refused(tmp_path):
    path = tmp_path / "y.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))  # a leftover of a dead run: a socket file nobody listens on
    dead.close()
    with Ingress(f"ipc://{path}"):
        with pytest.raises(EndpointError, match="already listening"):
            Ingress(f"ipc://{path}")
        assert path.exists()  # the live server keeps its socket
    assert not path.exists()


def test_an_ipc_path_that_is_not_a_socket_is_left_alone(tmp_path):
    """libzmq would replace whatever is there: a file or folder at the path is refused, never deleted."""
    precious = tmp_path / "precious.txt"
    precious.write_text("data")
    folder = tmp_path / "folder"
    folder.mkdir()
    for path in (precious, folder):
        with pytest.raises(EndpointError, match="is not a socket"):
            Ingress(f"ipc://{path}")
    assert precious.read_text() == "data" and folder.is_dir()
    with pytest.raises(EndpointError, match="cannot bind"):  # its "folder" is a file: a clear error
        Ingress(f"ipc://{precious}/under/a/file.sock")


def test_an_ipc_path_in_a_missing_folder_is_refused_and_no_folder_is_made(tmp_path):
    """Binding made the folder and every missing parent without a word; a client may still connect there."""
    endpoint = f"ipc://{tmp_path}/missing/dir/x.sock"
    with pytest.raises(EndpointError, match=f"the folder {tmp_path}/missing/dir does not exist"):
        Ingress(endpoint)
    assert not (tmp_path / "missing").exists()
    assert check_endpoint(endpoint) == endpoint


def test_tcp_loopback_binds_with_a_wildcard_port():
    with Ingress("tcp://127.0.0.1:*") as ing:
        assert ing.endpoint.startswith("tcp://127.0.0.1:") and not ing.endpoint.endswith("*")


@pytest.mark.parametrize("ep", ["tcp://0.0.0.0:5555", "tcp://192.168.1.4:5555", "tcp://*:5555", "tcp://eth0:1"])
def test_non_loopback_tcp_needs_the_allow_flag(ep):
    with pytest.raises(EndpointError, match="allow-remote"):
        check_bind(ep)
    assert check_bind(ep, allow_remote=True) == ep


@pytest.mark.parametrize("ep", ["tcp://127.0.0.1:5555", "tcp://localhost:1", "tcp://[::1]:80", "ipc:///tmp/a"])
def test_loopback_and_ipc_are_fine(ep):
    assert check_bind(ep) == ep


@pytest.mark.parametrize("ep", ["http://127.0.0.1:80", "ipc://relative.sock", "tcp://127.0.0.1", "inproc://x",
                                "tcp://127.0.0.1:65536", "tcp://127.0.0.1:99999"])
def test_nonsense_endpoints_are_refused(ep):
    with pytest.raises(EndpointError):
        check_bind(ep)


def test_default_endpoint_lives_in_the_runtime_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_endpoint("r1") == f"ipc://{tmp_path}/agentserve-r1.sock"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "missing"))
    assert default_endpoint("r1").startswith("ipc:///")
