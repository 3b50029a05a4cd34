"""The Qwen-style tool-call parser: valid calls, several calls, and malformed output that never raises; and the
check of whether a reply may still become JSON."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from agentserve.orchestrator.text.json_prefix import may_be_json
from agentserve.orchestrator.text.tool_calls import ToolCall, has_tool_call, parse_tool_calls


def test_single_call_and_content():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    r = parse_tool_calls(text)
    assert r.calls == [ToolCall("get_weather", {"city": "Paris"})]
    assert r.content == "Let me check."
    assert r.errors == []


def test_several_calls_string_arguments_and_unclosed_last_block():
    text = ('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "c", "parameters": {"y": [1, 2]}}')
    r = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in r.calls] == [("a", {"x": 1}), ("b", {}), ("c", {"y": [1, 2]})]
    assert r.content == "" and r.errors == []
    assert r.calls[0].arguments_json() == '{"x": 1}'


def test_malformed_blocks_become_errors_and_stay_in_content():
    text = ('ok <tool_call>{"name": "a", "arguments": {</tool_call> '
            '<tool_call>[1]</tool_call><tool_call>{"arguments": {}}</tool_call>'
            '<tool_call>{"name": "d", "arguments": 5}</tool_call><tool_call>{"name": "e", "arguments": "nope"}'
            '</tool_call><tool_call>{"name": "f"}</tool_call>')
    r = parse_tool_calls(text)
    assert [c.name for c in r.calls] == ["f"]
    assert len(r.errors) == 5
    assert "not valid JSON" in r.errors[0] and "JSON object" in r.errors[1] and "'name'" in r.errors[2]
    assert "must be a JSON object" in r.errors[3] and "not JSON" in r.errors[4]
    assert r.content.startswith('ok <tool_call>{"name": "a", "arguments": {</tool_call>')


def test_plain_text():
    r = parse_tool_calls("  just words  ")
    assert (r.content, r.calls, r.errors) == ("just words", [], [])
    assert not has_tool_call("just words") and has_tool_call("x <tool_call>")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(['<tool_call>', '</tool_call>', '{', '}', '"name"', ':', '"a"', ',',
                                 '"arguments"', '[', ']', ' ', 'x', '"', '\\', '1']), max_size=30).map("".join))
def test_never_raises(text):
    r = parse_tool_calls(text)
    assert all(isinstance(c, ToolCall) and isinstance(c.arguments, dict) for c in r.calls)


def test_what_a_model_may_write_never_raises_and_always_fits_the_wire():
    """A name with a bad escape or a raw newline, integers past 64 bits (or past int()'s 4,300 digits) and nesting
    deeper than the recursion limit once raised out of the parser (the turn ended `internal`, its reply lost)."""
    import msgspec

    from agentserve.orchestrator.text.tool_formats import HermesFormat, Llama3JsonFormat

    texts = [
        '<tool_call>{"name": "get\\_weather", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "a\nb", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "add", "arguments": {"a": 123456789012345678901234567890, "b": -' + "9" * 5000 + '}}',
        '<tool_call>{"name": "f", "arguments": {"x": ' + "[" * 5000 + "]" * 5000 + "}}</tool_call>",
        '{"name": "get\\_weather", "parameters": {"n": 18446744073709551616}}',
        '{"name": "f", "parameters": {"x": ' + "[" * 5000 + "]" * 5000 + "}}",  # a Llama-3 call nested too deeply
    ]
    for fmt in (HermesFormat(), Llama3JsonFormat()):
        for text in texts:
            for end in range(0, len(text) + 1, max(1, len(text) // 50)):
                fmt.scan(text[:end], final=False)
            fmt.scan(text, final=True)
            for call in fmt.parse(text):
                msgspec.msgpack.encode(call.arguments)
    (call,) = HermesFormat().parse(texts[2])
    assert call.arguments["a"] == 1.2345678901234568e29 and call.arguments["b"] == float("-inf")


JSON_PIECES = ['{', '}', '[', ']', ':', ',', ' ', '"', '"k"', '\\', 'u', '0', '1', '-', '.', 'e', '+', 'tr', 'ue',
               'n', 'null', 'NaN', '-Inf', 'inity', 'x', '\n', '\x01']
CLOSERS = ["", "}", "]}", '"}', "0}", ':1}', "1", '"', "]", "}}", '": 1}', "ue", "ll", "0]}", '"]}', "inity"]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(JSON_PIECES), min_size=1, max_size=12).map("".join))
def test_may_be_json_never_rules_out_what_json_reads(text: str) -> None:
    """Text Python's json reads the start of once some more is written is never ruled out (a Llama-3 reply is
    held back as a possible call exactly as long as this says it may be JSON)."""
    for more in CLOSERS:
        try:
            json.JSONDecoder().raw_decode(text.lstrip(" \t\n\r") + more)
        except (json.JSONDecodeError, RecursionError):
            continue
        assert may_be_json(text), (text, more)


def test_may_be_json_rules_out_text_at_the_first_character_json_refuses() -> None:
    whole = '{"name": "f", "parameters": {"x": [1, -2.5e+3, true, null, NaN, -Infinity, "\\"\\u00e9"], "y": {}}}'
    assert all(may_be_json(whole[:end]) for end in range(len(whole) + 1))
    assert may_be_json("[" * 5000)  # no recursion
    for text in ['{ h', '{"a" 1', '{"a": 01', '{"a": 1,}', '[1 2', '{"a":}', '{"a\x01', '{"a": "\\q', '{,', '[1.e',
                 '{"a": tx', '{1', '[}', '{"a": 1]', '{"a": -I1']:
        assert not may_be_json(text), text
