"""Chat completions through the real OpenAI SDK and langchain-openai: whole and streamed answers."""

from __future__ import annotations

import json

import pytest

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]


def test_whole_answer_has_the_openai_shape(openai_client) -> None:
    r = openai_client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "tiny"
    (choice,) = r.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens == 8 or choice.finish_reason == "stop"
    assert r.usage.prompt_tokens > 10 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def _streamed(client, **kwargs):
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    return chunks


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 1234}])
def test_streamed_text_equals_the_whole_text(openai_client, sampling) -> None:
    kwargs = {"model": "tiny", "messages": MESSAGES, "max_tokens": 24, **sampling}
    whole = openai_client.chat.completions.create(**kwargs)
    chunks = _streamed(openai_client, stream_options={"include_usage": True}, **kwargs)
    assert len({c.id for c in chunks}) == 1, "one id for every chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_usage_ends_with_the_finish_chunk(http) -> None:
    body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] == "length" and "usage" not in last


def test_n_choices_stop_strings_and_max_completion_tokens(openai_client) -> None:
    r = openai_client.chat.completions.create(model="tiny", messages=MESSAGES, n=3, max_completion_tokens=6,
                                              temperature=1.0, seed=5)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens <= 18
    first = openai_client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0)
    text = first.choices[0].message.content
    if len(text) >= 4:  # stop at a piece of what greedy decoding writes: the text ends before it
        stop = text[2:4]
        cut = openai_client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0,
                                                    stop=[stop])
        assert cut.choices[0].message.content == text[: text.index(stop)]
        assert cut.choices[0].finish_reason == "stop"


def test_streamed_choices_each_finish_once(openai_client) -> None:
    chunks = _streamed(openai_client, model="tiny", messages=MESSAGES, n=2, max_tokens=5, temperature=1.0, seed=9)
    finishes = [(c.choices[0].index, c.choices[0].finish_reason) for c in chunks if c.choices[0].finish_reason]
    assert sorted(finishes) == [(0, "length"), (1, "length")]


def test_n_choices_with_the_largest_seed_are_answered(http) -> None:
    """Choice i draws from seed + i: with the largest seed a client may send, choice 1's was 2**63, so a valid request
    got a 400 saying the seed must be in [0, 2**63), "got 9223372036854775808", a seed it never sent.  It wraps to 0;
    a seed out of range is still refused (choice 0 keeps it as given)."""
    body = {"messages": MESSAGES, "n": 2, "max_tokens": 2, "temperature": 1.0}
    r = http.post("/v1/chat/completions", json=body | {"seed": 2**63 - 1})
    assert r.status_code == 200 and [c["index"] for c in r.json()["choices"]] == [0, 1], r.text
    r = http.post("/v1/chat/completions", json=body | {"seed": 2**63})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_sampling", r.text


def test_langchain_chat_openai_invokes_and_streams(http_server) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=http_server.base_url, api_key=http_server.api_key, model="tiny", temperature=0,
                     max_tokens=8, max_retries=0)
    whole = llm.invoke("Hello there")
    streamed = "".join(chunk.content for chunk in llm.stream("Hello there"))
    assert streamed == whole.content
    assert whole.response_metadata["finish_reason"] in ("stop", "length")
