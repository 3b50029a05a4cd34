"""The ``chat`` dialect of the stateless-server driver: text messages, replies resent exactly as answered,
token counts topped up from the usage chunk, and the model taken from ``/v1/models`` when none is given."""

from __future__ import annotations

import asyncio

import pytest
from bench_fakes import FakeCompletionServer

from agentserve.bench.openai_driver import TEXT_ALPHABET, OpenAIDriver, ids_to_text


class FakeChatServer(FakeCompletionServer):
    """Streams a reply of ``pieces`` (one content chunk each; ``""`` is a chunk with no text, as a server
    holding back a partial UTF-8 character sends), then a usage chunk claiming ``tokens`` tokens; ``cut``
    closes the connection after the pieces, as a server that dies mid-reply."""

    def __init__(self, pieces: list[str], tokens: int, cut: bool = False) -> None:
        super().__init__()
        self.pieces, self.tokens, self.cut = pieces, tokens, cut
        self.json_replies["/v1/models"] = {"object": "list", "data": [{"id": "served-name"}]}

    def _events(self, path, body):
        yield {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
        for piece in self.pieces:
            yield {"choices": [{"index": 0, "delta": {"content": piece}}]}
        if not self.cut:
            yield {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
            yield {"choices": [], "usage": {"completion_tokens": self.tokens}}


def test_chat_turns_resend_the_conversation_with_replies_as_answered() -> None:
    async def main():
        async with FakeChatServer(["a\ufffd", "", "b"], tokens=4) as server:
            driver = OpenAIDriver(server.url, dialect="chat", model="m", pad_id=7)
            await driver.connect()
            session = await driver.open_session()
            first = [c async for c in session.turn([0, 1, 61, 62], 4)]
            second = [c async for c in session.turn([5], 4)]
            await session.close()
            return server, first, second

    server, first, second = asyncio.run(main())
    assert server.paths == ["/v1/chat/completions"] * 2  # a model was given: no /v1/models lookup
    # two content chunks with text, then the usage chunk's remainder: 4 tokens in all
    assert [ids for ids, _ in first] == [[7], [7], [7, 7]]
    assert sum(len(ids) for ids, _ in second) == 4
    b1, b2 = server.bodies
    assert b1["model"] == "m" and b1["max_tokens"] == 4 and b1["ignore_eos"] is True and b1["stream"] is True
    assert b1["stream_options"] == {"include_usage": True}
    assert b1["messages"] == [{"role": "user", "content": "ab9a"}]
    assert b2["messages"] == [{"role": "user", "content": "ab9a"}, {"role": "assistant", "content": "a\ufffdb"},
                              {"role": "user", "content": "f"}]


def test_chat_without_a_model_asks_the_server_which_it_serves() -> None:
    async def main():
        async with FakeChatServer(["x"], tokens=1) as server:
            driver = OpenAIDriver(server.url, dialect="chat")
            await driver.connect()
            session = await driver.open_session()
            [c async for c in session.turn([3], 1)]
            return server

    server = asyncio.run(main())
    assert server.paths == ["/v1/models", "/v1/chat/completions"]
    assert server.bodies[1]["model"] == "served-name"


def test_ids_to_text_is_one_alphanumeric_character_per_id() -> None:
    ids = list(range(300))
    text = ids_to_text(ids)
    assert len(text) == 300 and set(text) <= set(TEXT_ALPHABET)
    assert text == ids_to_text(ids) and text[:62] == TEXT_ALPHABET


def test_a_reply_cut_off_mid_stream_is_an_error() -> None:
    async def main():
        async with FakeChatServer(["a", "b"], tokens=5, cut=True) as server:
            session = await OpenAIDriver(server.url, dialect="chat", model="m").open_session()
            got = []
            with pytest.raises(ConnectionError, match="before the server finished"):
                async for chunk in session.turn([1], 5):
                    got.append(chunk)
            return got, session.messages

    got, messages = asyncio.run(main())
    assert len(got) == 2  # the tokens that did arrive were streamed
    assert messages == [{"role": "user", "content": "b"}]  # no reply was filed
