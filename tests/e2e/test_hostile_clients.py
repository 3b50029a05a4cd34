"""`agentserve up --model tiny` against hostile and broken peers (issue: no frame, stream or request can
take the server down or slow every agent):

- a client SIGSTOPped mid-stream with thousands of tokens pending is dropped (turn aborted, KV freed)
  within the stall bound;
- a neighbour's token gap stays within the TPOT SLO while another client floods stop strings, sends
  an over-limit text and a multi-megabyte prompt;
- a SIGSTOPped executor is detected as hung, killed and replaced; its running turn gets
  ``executor_failed`` and the session is served again.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import threading
import time

import pytest
from up_server import UpServer

from agentserve.client import AgentClient, ExecutorFailed, LimitExceeded, PromptTooLong, TokenIds
from agentserve.protocol.stats import Snapshot, decode_snapshot

STALL_S, HANG_FLOOR_S, TPOT_SLO_MS = 0.5, 2.0, 50.0
CONFIG = f"""
[clients]
stall_timeout_s = {STALL_S}
[executor]
hang_floor_s = {HANG_FLOOR_S}
hang_step_multiple = 20.0
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("hostile")
    (tmp / "limits.toml").write_text(CONFIG)
    srv = UpServer(tmp, ["--max-model-len", "4096", "--config", str(tmp / "limits.toml")])
    yield srv
    assert srv.stop() == 0, srv.logs()


def snapshot(server: UpServer) -> Snapshot:
    with AgentClient(server.endpoint) as client:
        return decode_snapshot(client.stats())


# Each event carries 20 alternatives' logprobs (~300 bytes): the socket buffers between a frozen client and the
# server then hold a few hundred events, not the whole turn.  With one bare token an event, on a fast CPU (Zen 5)
# the ingress's batched writes fit all 3,500 of them and the turn ended before anything stalled.
FROZEN_AGENT = """
import sys
from agentserve.client import AgentClient
with AgentClient(sys.argv[1]) as client:
    s = client.session(name="frozen")
    turn = s.turn([{"role": "user", "content": "go"}], max_tokens=3500, ignore_eos=True, logprobs=True, top_logprobs=20)
    for event in turn:
        print("streaming", flush=True)
        break
    import time; time.sleep(600)
"""


def test_a_client_frozen_mid_stream_is_dropped_and_its_kv_freed(server: UpServer) -> None:
    before = snapshot(server)
    proc = subprocess.Popen([sys.executable, "-c", FROZEN_AGENT, server.endpoint], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "streaming"
        os.kill(proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        while any(r.name == "frozen" for r in snapshot(server).sessions):
            assert time.monotonic() - t0 < 30, "the frozen client's session is still served"
            time.sleep(0.1)
        dropped_after = time.monotonic() - t0
        after = snapshot(server)
        # the turn decodes on while its events back up for STALL_S (the tiny model: ~2,500 tokens/s on a fast CPU)
        assert after.tokens_out - before.tokens_out < 3500, "the turn ran to its end instead of being aborted"
        assert after.kv.used_blocks <= before.kv.used_blocks
        assert after.turns_done == before.turns_done
        assert dropped_after < 15.0, f"dropped after {dropped_after:.1f} s"
        assert "gone: not reading" in server.logs() or "gone: disconnected" in server.logs()
    finally:
        proc.kill()
        proc.wait()


def _neighbour_gaps(server: UpServer, started: threading.Event, gaps: list[float]) -> None:
    with AgentClient(server.endpoint) as client, client.session(name="neighbour") as s:
        last = None
        for event in s.turn("stream steadily", max_tokens=1500, ignore_eos=True):
            if isinstance(event, TokenIds):
                now = time.monotonic()
                if last is not None and started.is_set():
                    gaps.append((now - last) * 1e3)
                last = now
                started.set()


def test_a_neighbour_keeps_its_token_gap_while_another_client_misbehaves(server: UpServer) -> None:
    gaps: list[float] = []
    started = threading.Event()
    neighbour = threading.Thread(target=_neighbour_gaps, args=(server, started, gaps))
    neighbour.start()
    assert started.wait(30)
    with AgentClient(server.endpoint) as client, client.session() as s:
        with pytest.raises(LimitExceeded, match="max_stop_strings"):
            s.turn("x", stop=[f"stop{i}" for i in range(250_000)], max_tokens=4).collect()
        with pytest.raises(LimitExceeded, match="max_text_bytes"):
            s.turn("y" * (5 * 2**20), max_tokens=4).collect()
        with pytest.raises(PromptTooLong):  # 3 MB: within the text bound, tokenised off the loop, too long
            s.turn("word " * 600_000, max_tokens=4).collect()
    neighbour.join(120)
    assert len(gaps) > 100
    median = statistics.median(gaps)
    assert median < TPOT_SLO_MS, f"neighbour's median token gap {median:.1f} ms"


def test_a_hung_executor_is_killed_and_replaced(server: UpServer) -> None:
    with AgentClient(server.endpoint) as client, client.session() as s:
        assert len(s.turn("before", max_tokens=4, ignore_eos=True).collect().token_ids) == 4
        stream = s.turn("a long answer", max_tokens=1500, ignore_eos=True)
        events = iter(stream)
        next(events)
        pid = server.executor_pid()
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        valve = threading.Timer(HANG_FLOOR_S + 15.0, os.kill, (pid, signal.SIGKILL))  # never hang the test
        valve.start()
        try:
            with pytest.raises(ExecutorFailed, match="hung"):
                for _ in events:
                    pass
        finally:
            valve.cancel()
        assert time.monotonic() - t0 < HANG_FLOOR_S + 5.0
        deadline = time.monotonic() + 60
        while True:
            try:
                again = s.turn("after", max_tokens=4, ignore_eos=True).collect()
                break
            except ExecutorFailed:
                assert time.monotonic() < deadline
                time.sleep(0.5)
        assert len(again.token_ids) == 4 and server.executor_pid() != pid
    assert "executor hung" in server.logs()
