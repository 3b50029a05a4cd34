"""The stateless-server driver and its small SSE client, against a local fake server."""

from __future__ import annotations

import asyncio

import pytest
from bench_fakes import FakeCompletionServer, tiny_workload

from agentserve.bench.http_sse import HTTPError, get
from agentserve.bench.openai_driver import OpenAIDriver
from agentserve.bench.replayer import run_closed_loop


async def _two_turns(server: FakeCompletionServer, dialect: str):
    driver = OpenAIDriver(server.url, dialect=dialect, model="m", pad_id=7)
    session = await driver.open_session()
    first = [c async for c in session.turn([1, 2, 3], 4)]
    second = [c async for c in session.turn([4, 5], 3)]
    await session.close()
    return first, second


def test_openai_dialect_streams_token_ids_and_resends_the_conversation():
    async def main():
        async with FakeCompletionServer() as server:
            first, second = await _two_turns(server, "openai")
            return server, first, second

    server, first, second = asyncio.run(main())
    assert [ids for ids, _ in first] == [[100], [101], [102], [103]]
    times = [t for _, t in first]
    assert times == sorted(times) and times[-1] > times[0]
    assert server.paths == ["/v1/completions"] * 2
    b1, b2 = server.bodies
    assert b1["prompt"] == [1, 2, 3] and b1["max_tokens"] == 4 and b1["stream"] is True
    assert b1["ignore_eos"] is True and b1["cache_prompt"] is True and b1["model"] == "m"
    # turn 2 resends prompt 1 + generated tokens + the new tool output
    assert b2["prompt"] == [1, 2, 3, 100, 101, 102, 103, 4, 5]
    assert [ids for ids, _ in second] == [[100], [101], [102]]


def test_llamacpp_dialect_counts_held_back_tokens_and_pads_their_ids():
    async def main():
        async with FakeCompletionServer(hold_back=True) as server:
            first, second = await _two_turns(server, "llamacpp")
            return server, first, second

    server, first, _ = asyncio.run(main())
    assert server.paths == ["/completion"] * 2
    assert server.bodies[0]["n_predict"] == 4 and server.bodies[0]["return_tokens"] is True
    # the event of token 1 was held back: token 2's event reports two tokens, id 101 unknown
    assert [ids for ids, _ in first] == [[100], [7, 102], [103]]
    assert server.bodies[1]["prompt"] == [1, 2, 3, 100, 7, 102, 103, 4, 5]


@pytest.mark.parametrize("usage_on_last", [False, True], ids=["usage-chunk", "usage-on-last-chunk"])
def test_openai_dialect_counts_every_token_of_a_chunk_without_ids(usage_on_last):
    """A server that ignores ``return_token_ids`` and sends two tokens' text per chunk: the usage (a chunk of its
    own, or on the last one as llama-server sends it) tops the count up, so TPOT and throughput see every token
    and the resent conversation keeps its length."""
    async def main():
        async with FakeCompletionServer(pairs=True, usage_on_last=usage_on_last) as server:
            first, _ = await _two_turns(server, "openai")
            return server, first

    server, first = asyncio.run(main())
    assert server.bodies[0]["stream_options"] == {"include_usage": True}
    assert sum(len(ids) for ids, _ in first) == 4
    assert len(server.bodies[1]["prompt"]) == 3 + 4 + 2


@pytest.mark.parametrize("dialect", ["openai", "llamacpp"])
def test_a_stream_cut_before_the_server_finished_is_an_error(dialect):
    async def main():
        async with FakeCompletionServer(cut_after=2) as server:
            session = await OpenAIDriver(server.url, dialect=dialect).open_session()
            return [chunk async for chunk in session.turn([1, 2, 3], 4)]

    with pytest.raises(ConnectionError, match="after 2 tokens before the server finished"):
        asyncio.run(main())


def test_http_errors_are_raised_with_the_body():
    async def main():
        async with FakeCompletionServer(status=400) as server:
            session = await OpenAIDriver(server.url).open_session()
            with pytest.raises(HTTPError, match="bad request"):
                [c async for c in session.turn([1], 2)]
            return await get(server.url + "/health")

    assert asyncio.run(main()) == (200, b'{"status":"ok"}')


def test_replayer_over_http_end_to_end():
    async def main():
        async with FakeCompletionServer() as server:
            return await run_closed_loop(OpenAIDriver(server.url), tiny_workload(agents=2, steps=2),
                                         duration_s=0.3)

    run = asyncio.run(main())
    assert run.requests and all(r.ok and r.n_tokens == r.max_tokens for r in run.requests)


def test_unknown_dialect_and_bad_url_are_rejected():
    with pytest.raises(ValueError):
        OpenAIDriver("http://x", dialect="grpc")
    with pytest.raises(ValueError):
        asyncio.run(get("https://example.invalid/"))


def test_extra_body_is_sent_with_every_turn():
    async def main():
        async with FakeCompletionServer() as server:
            driver = OpenAIDriver(server.url, dialect="llamacpp", extra_body={"logit_bias": [[200, False]]})
            session = await driver.open_session()
            [c async for c in session.turn([1, 2], 2)]
            [c async for c in session.turn([3], 2)]
            return server.bodies

    bodies = asyncio.run(main())
    assert [b["logit_bias"] for b in bodies] == [[[200, False]]] * 2


def test_built_in_models_stream_ascii_only_from_llama_server():
    from agentserve.bench.servers import ascii_only_bias

    bias = ascii_only_bias("tiny")["logit_bias"]
    assert bias[0] == [128, False] and [i for i, _ in bias] == list(range(128, 320))
    assert ascii_only_bias("/models/Qwen2.5-3B") == {}
