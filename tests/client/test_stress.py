"""Many clients and sessions at once: every stream gets exactly its own tokens, and clients that
vanish mid-stream are reported gone without disturbing the others."""

from __future__ import annotations

import random
import threading
import time

from agentserve.client import AgentClient


def test_threads_each_with_a_client_get_only_their_own_tokens(server):
    errors: list[BaseException] = []

    def agent(i: int) -> None:
        rng = random.Random(i)
        try:
            with AgentClient(server.endpoint) as client:
                sessions = [client.session(name=f"t{i}-{k}") for k in range(2)]
                for step in range(4):
                    texts = [f"{i}:{k}:{step}:" + "x" * rng.randint(1, 40) for k in range(2)]
                    streams = [s.turn(t) for s, t in zip(sessions, texts, strict=True)]
                    for stream, text in reversed(list(zip(streams, texts, strict=True))):
                        res = stream.collect()
                        assert res.text == text and res.token_ids == list(text.encode())
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    deadline = time.monotonic() + 10
    while len(server.table) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(server.table) == 0  # the sessions went with their clients
    assert len(server.gone) == 8 == len(set(server.gone))


def test_clients_vanishing_mid_stream_are_all_reported_and_others_finish(slow_server):
    doomed = [AgentClient(slow_server.endpoint) for _ in range(5)]
    streams = []
    for c in doomed:
        s = c.session()
        stream = s.turn("d" * 400)
        next(iter(stream))
        streams.append(stream)
    with AgentClient(slow_server.endpoint) as survivor:
        s = survivor.session()
        stream = s.turn("survive")
        for c in doomed:
            c.close()
        assert stream.collect().text == "survive"
        deadline = time.monotonic() + 10
        while len(slow_server.aborted) < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sorted(slow_server.aborted) == sorted(st.req for st in streams)
        assert [e.session for e in slow_server.table.values()] == [s.id]
