"""`agentserve up --model tiny` for real: concurrent agents, `top`, bad input, an executor crash, SIGTERM.

One server serves the whole module (start-up costs seconds); the tests run in file order and the
last one stops it and checks that nothing is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import msgspec
import pytest
import zmq
from rich.console import Console
from up_server import DEVICE, UpServer

from agentserve.cli.top_view import render
from agentserve.client import AgentClient, ExecutorFailed, InvalidRequest, InvalidSampling, PromptTooLong
from agentserve.executor.builtin import resolve_model
from agentserve.executor.runner import ModelRunner
from agentserve.executor.sequences import SequenceTable
from agentserve.executor.step import StepExecutor
from agentserve.orchestrator.text.tokenization import Tokenizer
from agentserve.protocol.client_messages import (
    ClientCodec,
    CloseSession,
    ErrorCode,
    OpenSession,
    SessionClosed,
    TokenEvent,
    Turn,
)
from agentserve.protocol.lanes import Lane
from agentserve.protocol.ring_messages import Plan, SeqPlan
from agentserve.protocol.sampling import SamplingParams
from agentserve.protocol.stats import decode_snapshot

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web.",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
        },
    }
]
SYSTEM = "You are a careful agent. Use tools when needed."
AGENT_SAMPLING = [
    {"temperature": 0.0},
    {"temperature": 0.0},
    {"temperature": 1.0, "seed": 7},
    {"temperature": 0.8, "seed": 11},
]
# No top-k / top-p here: the random tiny model's distributions are nearly flat, so a nucleus boundary
# moves with last-bit differences between batched and single-sequence matmuls.  The sampler's unit
# tests cover the filters; this test covers seeds, batching, chunking and prefix reuse end to end.


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    srv = UpServer(tmp_path_factory.mktemp("up"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference():
    """Offline generation on the same weights: one sequence, prefill then decode, no scheduler."""
    model = resolve_model("tiny")
    runner = ModelRunner(model, dtype="float32", device=DEVICE, num_blocks=256)
    tok = Tokenizer.from_dir(model)

    def generate(prompt: list[int], params: SamplingParams) -> list[int]:
        ex = StepExecutor(runner, SequenceTable(runner.device), tok.eos_token_ids)
        blocks = list(range(-(-(len(prompt) + params.max_tokens) // 16)))
        plan = SeqPlan(0, prompt, 0, new_blocks=blocks, sampling=params)
        (res,) = ex.run(Plan(0, Lane.DECODE, 0, 0, [plan]))
        out = [res.token_id]
        while not res.finish:
            step = Plan(len(out), Lane.DECODE, 0, 0, [SeqPlan(0, [], len(prompt) + len(out) - 1)])
            (res,) = ex.run(step)
            out.append(res.token_id)
        return out

    return tok, generate


def _agent(endpoint: str, index: int, results: dict, errors: list) -> None:
    try:
        with (
            AgentClient(endpoint, name=f"agent{index}") as client,
            client.session(system=SYSTEM, tools=TOOLS, name=f"agent{index}") as s,
        ):
            turns = []
            messages = [{"role": "user", "content": f"Task {index}: find the population of city #{index}."}]
            for turn in range(3):
                events = list(s.turn(messages, max_tokens=12, **AGENT_SAMPLING[index]))
                ids = [t for e in events if hasattr(e, "token_ids") for t in e.token_ids]
                turns.append((messages, ids))
                messages = [{"role": "tool", "content": f"result {turn} for agent {index}"}]
            results[index] = turns
    except Exception as e:  # reported by the test
        errors.append((index, repr(e)))


def test_four_agents_match_offline_generation(server: UpServer, reference) -> None:
    tok, generate = reference
    with AgentClient(server.endpoint) as client:  # the ids that end a turn, as the gateway needs them
        assert client.server.eos_token_ids and all(0 <= t < tok.vocab_size for t in client.server.eos_token_ids)
    results: dict = {}
    errors: list = []
    threads = [threading.Thread(target=_agent, args=(server.endpoint, i, results, errors)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for index in range(4):
        # The conversation at the token level: each reply stays as the tokens the model produced
        # (its text need not re-tokenize to them, e.g. an unused vocabulary id decodes to nothing),
        # and only the newly rendered template text is tokenized.
        conversation = [{"role": "system", "content": SYSTEM}]
        params = SamplingParams(max_tokens=12, **AGENT_SAMPLING[index])
        said_text, said_tokens = "", []
        for messages, got in results[index]:
            conversation += messages
            text = tok.apply_chat_template(conversation, TOOLS, add_generation_prompt=True)
            assert text.startswith(said_text)
            prompt = said_tokens + tok.encode(text[len(said_text) :], add_special_tokens=False)
            expected = generate(prompt, params)
            assert got == expected, f"agent {index}: served tokens differ from offline generation"
            out = expected[:-1] if expected[-1] in tok.eos_token_ids else expected
            reply = tok.decode(out, skip_special_tokens=False)
            conversation.append({"role": "assistant", "content": reply})
            said_text, said_tokens = text + reply, prompt + out
    steps = [json.loads(line) for line in server.trace.read_text().splitlines()]
    assert {s["lane"] for s in steps} == {"decode", "prefill"}, "--trace-steps wrote the steps of both lanes"


def test_top_once_json_shows_sessions(server: UpServer) -> None:
    with AgentClient(server.endpoint) as client:
        sessions = [client.session(system=SYSTEM, name=f"watch{i}") for i in range(4)]
        for s in sessions:
            s.turn("hello", max_tokens=3).collect()
        time.sleep(0.3)  # one stats period
        out = subprocess.run(
            ["agentserve", "top", "--run", server.run, "--once", "--json"], capture_output=True, text=True, timeout=30
        )
        assert out.returncode == 0, out.stderr
        snap = json.loads(out.stdout)
        names = {row["name"] for row in snap["sessions"]}
        assert {f"watch{i}" for i in range(4)} <= names
        backend = snap["partition"]["backend"]
        assert backend in ({"cpu-cores"} if DEVICE == "cpu" else {"green-ctx", "cuda-streams"})
        assert snap["kv"]["total_blocks"] == 512 and snap["turns_done"] >= 4
        # The dashboard renders real stats at 80 columns and wide.
        data = client.stats()
        for width in (80, 200):
            console = Console(record=True, width=width, height=24, file=open(os.devnull, "w"))  # noqa: SIM115
            console.print(render(decode_snapshot(data), width, 24))
            text = console.export_text()
            # the frame as the message: pytest's own repr elides its middle (on the H200 it looked three lines long)
            assert "watch0" in text and f"backend {backend}" in text, text
        for s in sessions:
            s.close()


def _raw(endpoint: str):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10000)
    sock.connect(endpoint)
    return sock


def test_bad_input_gets_typed_errors_and_server_keeps_serving(server: UpServer) -> None:
    sock = _raw(server.endpoint)
    codec = ClientCodec()  # the client's side: encodes requests, decodes events
    decode, encode = codec.decode, codec.encode
    cases = [
        (b"\x00garbage", ErrorCode.MALFORMED_FRAME),
        (msgspec.msgpack.encode(["no_such_type", 1]), ErrorCode.UNKNOWN_MESSAGE),
        (encode(OpenSession(req=1, version=999)), ErrorCode.UNSUPPORTED_VERSION),
        (encode(Turn(req=2, session=4242, token_ids=[1, 2])), ErrorCode.UNKNOWN_SESSION),
    ]
    for payload, code in cases:
        sock.send(payload)
        while not (reply := sock.recv()):
            pass  # liveness probes
        err = decode(reply)
        assert err.code == code, (payload, err)
    sock.close()
    with AgentClient(server.endpoint) as client, client.session(system=SYSTEM) as s:
        with pytest.raises(PromptTooLong):
            s.turn(token_ids=[5] * 5000, max_tokens=4).collect()
        with pytest.raises(InvalidSampling):
            s.turn("hi", max_tokens=4, temperature=-1.0).collect()
        with pytest.raises(InvalidSampling):
            s.turn("hi", max_tokens=0).collect()
        with pytest.raises(InvalidRequest, match="outside the vocabulary"):
            s.turn(token_ids=[10**6], max_tokens=2).collect()
        assert s.turn("still fine?", max_tokens=4).collect().done is not None
    # Two turns at once on one session: the raw protocol (the SDK aborts a previous turn itself).
    with AgentClient(server.endpoint) as client, client.session() as s:
        sock = _raw(server.endpoint)
        sock.send(encode(OpenSession(req=1, version=1)))
        opened = decode(sock.recv())
        sock.send(encode(Turn(req=2, session=opened.session, token_ids=[1, 2, 3], max_tokens=200, ignore_eos=True)))
        sock.send(encode(Turn(req=3, session=opened.session, token_ids=[4], max_tokens=2)))
        codes = set()
        deadline = time.monotonic() + 30
        while ErrorCode.TURN_IN_PROGRESS not in codes and time.monotonic() < deadline:
            msg = sock.recv()
            if msg:
                ev = decode(msg)
                codes.add(getattr(ev, "code", None))
        assert ErrorCode.TURN_IN_PROGRESS in codes
        # req 0 once read as "no turn running": a second turn beside it broke the scheduler (internal, twice)
        sock.send(encode(Turn(req=0, session=opened.session, token_ids=[4], max_tokens=2)))
        while not (reply := sock.recv()) or not hasattr(decode(reply), "code"):
            pass
        err = decode(reply)
        assert err.code == ErrorCode.INVALID_REQUEST and "positive" in err.message, err
        sock.close()
        assert len(s.turn(token_ids=[7, 8], max_tokens=3).collect().token_ids) == 3


def _event(codec: ClientCodec, frame: bytes):
    return codec.decode(frame) if frame else None  # an empty frame is a liveness probe


def test_closing_a_session_mid_turn_ends_its_stream(server: UpServer) -> None:
    codec = ClientCodec()
    sock = _raw(server.endpoint)
    sock.send(codec.encode(OpenSession(req=1, version=1)))
    opened = codec.decode(sock.recv())
    sock.send(codec.encode(Turn(req=2, session=opened.session, token_ids=[1, 2], max_tokens=500, ignore_eos=True)))
    while not isinstance(_event(codec, sock.recv()), TokenEvent):
        pass  # until the turn is streaming
    sock.send(codec.encode(CloseSession(req=3, session=opened.session)))
    ends = []
    while len(ends) < 2:
        ev = _event(codec, sock.recv())
        if ev is not None and not isinstance(ev, TokenEvent):
            ends.append(ev)
    assert ends[0].req == 2 and ends[0].code == ErrorCode.ABORTED, ends
    assert isinstance(ends[1], SessionClosed) and ends[1].req == 3
    sock.close()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])  # SIGTERM: it exits by itself, closing its rings
def test_executor_crash_is_reported_and_recovered(server: UpServer, sig: signal.Signals) -> None:
    logged = len(server.logs())
    with AgentClient(server.endpoint) as client, client.session(system=SYSTEM) as s:
        first = s.turn("before the crash", max_tokens=4).collect()
        stream = s.turn("a long answer, please", max_tokens=400, ignore_eos=True)
        events = iter(stream)
        next(events)  # the turn is streaming
        t0 = time.monotonic()
        os.kill(server.executor_pid(), sig)
        with pytest.raises(ExecutorFailed):
            for _ in events:
                pass
        assert time.monotonic() - t0 < 3.0
        # The session survives: a new turn on it is served by the restarted executor.
        deadline = time.monotonic() + 60
        while True:
            try:
                again = s.turn("after the crash", max_tokens=4).collect()
                break
            except ExecutorFailed:
                assert time.monotonic() < deadline
                time.sleep(0.5)
        assert again.done is not None and len(again.token_ids) == 4 and first.done is not None
    after = server.logs()[logged:]
    assert "restarting the executor" in after and "executor restarted: serving again" in after


def test_sigterm_exits_zero_and_leaves_nothing(server: UpServer) -> None:
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=30) == 0, server.logs()
    assert not server.sock.exists()
    leftovers = [n for n in os.listdir("/dev/shm") if server.run in n]
    assert not leftovers, leftovers
