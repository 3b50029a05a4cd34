"""Many streams at once, and a client that disconnects mid-stream: its turn is aborted at once."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest


def test_sixteen_concurrent_streams(http_server) -> None:
    from openai import AsyncOpenAI

    async def one(client: AsyncOpenAI, i: int) -> tuple[str, str | None, int]:
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"agent {i}"}], max_tokens=12, temperature=1.0,
            seed=i, stream=True, stream_options={"include_usage": True})
        text, finish, usage = "", None, 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            elif chunk.usage:
                usage = chunk.usage.completion_tokens
        return text, finish, usage

    async def main() -> list:
        async with AsyncOpenAI(base_url=http_server.base_url, api_key=http_server.api_key, max_retries=0,
                               timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    results = asyncio.run(main())
    assert all(finish in ("stop", "length") for _, finish, _ in results)
    assert all(0 < n <= 12 for _, _, n in results)


def _decoding(snapshot) -> list:
    return [row for row in snapshot.sessions if row.state.value in ("decoding", "prefilling")]


@pytest.mark.parametrize("stream", [True, False])
def test_a_disconnect_aborts_the_turn_and_frees_its_kv(http_server, stream) -> None:
    before = http_server.snapshot()
    idle_kv, tokens_before = before.kv.used_blocks, before.tokens_out
    max_tokens = 3500  # `tiny` decodes ~1,500 tokens/s: the client leaves well before the turn could end
    body = {"messages": [{"role": "user", "content": "a very long story"}], "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": stream}
    with httpx.Client(base_url=http_server.url, headers=http_server.headers(), timeout=5) as client:
        if stream:
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                lines = r.iter_lines()
                while not next(lines).startswith('data: {"id"'):
                    pass
                next(lines)  # the turn is streaming
        else:
            with pytest.raises(httpx.ReadTimeout):
                client.post("/v1/chat/completions", json=body, timeout=0.5)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        snap = http_server.snapshot()
        if not _decoding(snap) and snap.kv.used_blocks <= idle_kv:
            break
        time.sleep(0.1)
    assert not _decoding(snap), "the turn kept running after its client left"
    assert snap.kv.used_blocks <= idle_kv, "its KV was not freed"
    assert snap.tokens_out < tokens_before + max_tokens - 500, "decoding stopped long before max_tokens"
