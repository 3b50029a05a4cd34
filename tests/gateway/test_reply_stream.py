"""Tool-call delta streaming: however a reply is split into deltas, the sum of the deltas is the same,
and it matches the format's own parse of the whole reply."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentserve.gateway.reply_stream import CallDelta, ContentDelta, ReplyStreamer
from agentserve.orchestrator.text.tool_formats import HermesFormat, Llama3JsonFormat, format_for_template

HERMES_REPLIES = [
    'Let me look.\n<tool_call>\n{"name": "search", "arguments": {"q": "a }b", "n": {"k": [1, 2]}}}\n</tool_call>',
    '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {"x": 1}}\n'
    "</tool_call>",
    '<tool_call>{"arguments": {"x": 1}, "name": "late"}</tool_call>',  # name after arguments: sent whole at the end
    '<tool_call>\n{"name": "cut", "arguments": {"q": "unfinis',  # cut by max_tokens: a call, arguments as written
    "no call at all, just text with a < and <tool in it  ",
    "text then a broken block <tool_call>{not json}</tool_call> and more",
]
LLAMA_REPLIES = [
    '{"name": "search", "parameters": {"q": "x"}}',
    '<|python_tag|>{"name": "a", "parameters": {"v": [1]}}; {"name": "b", "parameters": {}}',
    "Plain answer.",
    '{"parameters": {"q": 1}, "name": "late"}',  # name after parameters: a call, known once the object closes
    '{"answer": 42} and then more prose',  # a JSON object that is no call: plain text
    '{"answer": 42}; {"name": "a", "parameters": {}}',  # no call first: the whole reply is plain text
    "{ a brace, then prose",
]


def run(streamer: ReplyStreamer, pieces: list[str]) -> tuple[str, list[tuple[str, str, str]], list]:
    deltas = []
    for p in pieces:
        deltas += streamer.feed(p)
    deltas += streamer.finish()
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if isinstance(d, CallDelta):
            if d.id is not None:
                assert d.index == len(calls), "calls start in order, each once"
                calls[d.index] = [d.id, d.name, ""]
            calls[d.index][2] += d.arguments
    return content, [tuple(c) for c in calls.values()], deltas


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(HERMES_REPLIES + LLAMA_REPLIES), st.lists(st.integers(0, 10_000), max_size=30))
def test_any_split_gives_the_same_reply(reply: str, cuts: list[int]) -> None:
    fmt = Llama3JsonFormat() if reply in LLAMA_REPLIES else HermesFormat()
    content, calls, _ = run(ReplyStreamer(fmt), split(reply, cuts))
    one_content, one_calls, _ = run(ReplyStreamer(fmt), [reply])
    assert content == one_content
    assert [(n, a) for _, n, a in calls] == [(n, a) for _, n, a in one_calls]


def test_calls_match_the_formats_parse() -> None:
    for reply in HERMES_REPLIES[:3] + LLAMA_REPLIES[:2] + LLAMA_REPLIES[3:4]:
        fmt = Llama3JsonFormat() if reply in LLAMA_REPLIES else HermesFormat()
        _, calls, _ = run(ReplyStreamer(fmt), list(reply))
        parsed = fmt.parse(reply)
        assert [(n, json.loads(a)) for _, n, a in calls] == [(c.name, c.arguments) for c in parsed]


def test_arguments_stream_before_the_call_ends_and_content_holds_back_a_tag_prefix() -> None:
    s = ReplyStreamer(HermesFormat())
    assert s.feed("Hi <tool") == [ContentDelta("Hi")]  # "<tool" may start <tool_call>: held back
    assert s.feed("_call>\n") == []
    header = s.feed('{"name": "search", "arguments": {"q": "ab')
    assert header[0] == CallDelta(0, "", header[0].id, "search") and header[0].id.startswith("call_")
    assert header[1] == CallDelta(0, '{"q": "ab')
    assert s.feed('c"}') == [CallDelta(0, 'c"')]  # a closing brace may be the call's own: held back
    assert s.feed("}\n</tool_call>") == [CallDelta(0, "}")]
    assert s.finish() == []
    assert s.content == "Hi" and s.content_or_none == "Hi"


@pytest.mark.parametrize(("reply", "held"), [
    ('{"answer": 42} and then more prose', len('{"answer": 42')),  # may still get a "name": held until it closes
    ('{"q": [1, {"k": null}], "n": "}"}\nthe rest', len('{"q": [1, {"k": null}], "n": "}"')),
    ("{ a brace, then prose", len("{ ")),  # shown at the first character that is no JSON
    ('{"a" is a key', len('{"a" ')),
    ('{"answer": 42}; {"name": "a", "parameters": {}}', len('{"answer": 42')),  # no call first: no call
    ('<|python_tag|>{"name" "f"}', len('<|python_tag|>{"name" ')),
])
def test_llama_text_that_cannot_become_a_call_is_shown_as_soon_as_that_is_known(reply: str, held: int) -> None:
    """Fed a character at a time, a reply that starts with ``{`` is held back only while it may still become
    a call; from the character that rules a call out, everything written so far is content."""
    s = ReplyStreamer(Llama3JsonFormat())
    shown = ""
    for end in range(1, len(reply) + 1):
        deltas = s.feed(reply[end - 1])
        assert all(isinstance(d, ContentDelta) for d in deltas)
        shown += "".join(d.text for d in deltas)
        assert shown == ("" if end <= held else reply[:end]), end
    assert s.finish() == [] and not s.calls and s.content == reply


def test_cut_call_and_invalid_blocks() -> None:
    content, calls, _ = run(ReplyStreamer(HermesFormat()), list(HERMES_REPLIES[3]))
    assert content == "" and calls[0][1:] == ("cut", '{"q": "unfinis')
    broken = HERMES_REPLIES[5]
    content, calls, _ = run(ReplyStreamer(HermesFormat()), list(broken))
    assert calls == [] and content == broken, "no valid call: the whole reply is content"


TWO_CALLS = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n'


@pytest.mark.parametrize("reply, unfinished", [
    ('<tool_call>\n{"name": "w", "arguments": {"city": "', True),  # a stop string or eos inside the call
    ('<tool_call>\n{"name": "w", "arguments": {"city": "Rome"}}\n</tool_call>', False),
    (TWO_CALLS + '{"name": "b", "arguments": {"x": 1', True),
    (TWO_CALLS + '{"name": "b", "argu', False),  # b never started (its name not followed by arguments): left out
    ("no call", False),
])
def test_a_reply_that_ends_inside_a_started_call_says_so(reply: str, unfinished: bool) -> None:
    streamer = ReplyStreamer(HermesFormat())
    run(streamer, [reply[:30], reply[30:]])
    assert streamer.unfinished is unfinished


def test_no_tools_means_plain_text() -> None:
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
    content, calls, _ = run(ReplyStreamer(None), list(text))
    assert content == text and calls == []


def test_format_follows_the_chat_template() -> None:
    assert format_for_template("{{ '<|python_tag|>' }}").name == "llama3_json"
    assert format_for_template("<tool_call>").name == "hermes"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 10_000), max_size=20))
def test_one_call_at_most_leaves_the_rest_out_however_split(cuts: list[int]) -> None:
    """``parallel_tool_calls: false``: the first call only, streamed or whole, and the streamer says it dropped."""
    reply = HERMES_REPLIES[1]  # two calls, a then b
    s = ReplyStreamer(HermesFormat(), max_calls=1)
    _, calls, _ = run(s, split(reply, cuts))
    assert [(n, json.loads(a)) for _, n, a in calls] == [("a", {})] and s.dropped and len(s.calls) == 1
    single = ReplyStreamer(HermesFormat(), max_calls=1)
    run(single, [HERMES_REPLIES[0]])
    assert not single.dropped and len(single.calls) == 1


@pytest.mark.parametrize(("reply", "name"), [
    ('Let me see. <tool_call>\nnot json at all\n</tool_call>\n'
     '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>', "b"),  # the broken block is no call
    ('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>{not json}</tool_call>', "a"),
])
def test_only_a_real_call_counts_against_the_limit(reply: str, name: str) -> None:
    for pieces in ([reply], list(reply)):
        s = ReplyStreamer(HermesFormat(), max_calls=1)
        _, calls, _ = run(s, pieces)
        assert [n for _, n, _ in calls] == [name] and not s.dropped, (pieces[:1], calls, s.dropped)
