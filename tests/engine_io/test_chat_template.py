"""Chat templates rendered by us against transformers' apply_chat_template, with and without tools."""

from __future__ import annotations

import pytest

from agentserve.orchestrator.text.chat_template import ChatTemplateError, render
from agentserve.orchestrator.text.tokenization import Tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city — ünïcode & <html> stay as they are",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}

PLAIN = [{"role": "user", "content": "Hello there"}]
WITH_SYSTEM = [
    {"role": "system", "content": "  Be terse.  "},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3? 東京 🙂"},
]
AGENT_TURN = [
    {"role": "system", "content": "You are an agent."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": '{"temp": 21, "sky": "clear"}'},
    {"role": "assistant", "content": "It is 21 °C and clear."},
    {"role": "user", "content": "Thanks"},
]
TWO_RESULTS = [
    {"role": "user", "content": "Look both up"},
    {"role": "assistant", "content": "Sure.", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
        {"function": {"name": "search", "arguments": '{"q": "Oslo"}'}},
    ]},
    {"role": "tool", "content": "cold"},
    {"role": "tool", "content": "a city"},
]

TINY_CASES = [
    (PLAIN, None), (WITH_SYSTEM, None), (AGENT_TURN, None), (PLAIN, [WEATHER]),
    (WITH_SYSTEM, [WEATHER, SEARCH]), (AGENT_TURN, [WEATHER]), (TWO_RESULTS, [WEATHER, SEARCH]),
]
LLAMA_CASES = [
    (PLAIN, None), (WITH_SYSTEM, None), (PLAIN, [WEATHER]), (WITH_SYSTEM, [WEATHER, SEARCH]), (AGENT_TURN, [WEATHER]),
]


@pytest.mark.parametrize("gen_prompt", [True, False])
@pytest.mark.parametrize(("messages", "tools"), TINY_CASES)
def test_builtin_template_matches_transformers(tiny_dir, hf_tiny_tokenizer, messages, tools, gen_prompt):
    ours = Tokenizer.from_dir(tiny_dir)
    want = hf_tiny_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                 add_generation_prompt=gen_prompt)
    got = ours.apply_chat_template(messages, tools=tools, add_generation_prompt=gen_prompt)
    assert got == want
    ids = hf_tiny_tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False,
                                                add_generation_prompt=gen_prompt)
    assert ours.encode_chat(messages, tools=tools, add_generation_prompt=gen_prompt) == list(ids)


@pytest.mark.parametrize(("messages", "tools"), LLAMA_CASES)
def test_llama_style_template_matches_transformers(llama_style_dir, hf_llama_style_tokenizer, messages, tools):
    ours = Tokenizer.from_dir(llama_style_dir)
    kw = {"date_string": "26 Jul 2024"}
    want = hf_llama_style_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                        add_generation_prompt=True, **kw)
    got = ours.apply_chat_template(messages, tools=tools, **kw)
    assert got == want
    assert got.startswith("<|begin_of_text|>")  # bos_token reached the template
    if tools:
        assert '    "type": "function"' in got  # tojson(indent=4), no HTML escaping below
        assert "<html>" in got and "ünïcode" in got


def test_strftime_now_is_available(llama_style_dir, hf_llama_style_tokenizer):
    ours = Tokenizer.from_dir(llama_style_dir).apply_chat_template(PLAIN)
    assert ours == hf_llama_style_tokenizer.apply_chat_template(PLAIN, tokenize=False, add_generation_prompt=True)


def test_tool_calls_render_in_qwen_format(tiny_dir):
    text = Tokenizer.from_dir(tiny_dir).apply_chat_template(TWO_RESULTS, tools=[WEATHER])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert '{"name": "search", "arguments": {"q": "Oslo"}}' in text  # string arguments are not re-encoded
    assert "<|im_start|>user\n<tool_response>\ncold\n</tool_response>\n<tool_response>\na city\n</tool_response>" \
        "<|im_end|>" in text
    assert "<tools>\n" + '{"type": "function", "function": {"name": "get_weather"' in text


def test_raise_exception_becomes_typed_error(llama_style_dir):
    tok = Tokenizer.from_dir(llama_style_dir)
    bad = [{"role": "user", "content": "x"},
           {"role": "assistant", "tool_calls": [{"function": {"name": "a", "arguments": {}}}] * 2}]
    with pytest.raises(ChatTemplateError, match="single tool-calls"):
        tok.apply_chat_template(bad)


def test_sandbox_blocks_internals():
    with pytest.raises(ChatTemplateError):
        render("{{ messages.__class__.__mro__ }}", PLAIN)
    with pytest.raises(ChatTemplateError):
        render("{% set ns = namespace() %}{% set ns._x = 1 %}", PLAIN)


def test_template_errors_are_clear():
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render("{% if %}", PLAIN)
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        render("{{ 1 }}", [])
    tok_without = Tokenizer(None, {}, {}, [])  # type: ignore[arg-type]
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok_without.apply_chat_template(PLAIN)


WHITESPACE_TEMPLATE = """{% for m in messages %}
    {% if m.role == 'user' %}
  [U] {{ m.content }}
    {% else %}
  {% generation %}[A] {{ m.content }}{% endgeneration %}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}[A]{% endif %}
"""


def test_block_whitespace_matches_transformers():
    """trim_blocks / lstrip_blocks and the generation tag, on a template written without ``-``."""
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = WITH_SYSTEM[1:]
    (want,), _ = render_jinja_template([messages], chat_template=WHITESPACE_TEMPLATE, add_generation_prompt=True)
    assert render(WHITESPACE_TEMPLATE, messages) == want
    assert want.startswith("  [U] What is 2+2?\n[A] 4  [U]")
