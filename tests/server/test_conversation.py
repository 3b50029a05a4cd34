"""A session's conversation: full prompts per turn that keep the cached tokens exact."""

from __future__ import annotations

import pytest

from agentserve.executor.builtin import resolve_model
from agentserve.orchestrator.conversation import Conversation
from agentserve.orchestrator.text.tokenization import Tokenizer
from agentserve.protocol.client_messages import Message, ProtocolError, Turn


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(resolve_model("tiny"))


def _turn(*messages: tuple[str, str], token_ids: list[int] | None = None) -> Turn:
    return Turn(req=1, session=1, messages=[Message(r, c) for r, c in messages], token_ids=token_ids or [])


def test_chat_prompt_is_the_rendered_conversation(tok: Tokenizer) -> None:
    conv = Conversation(tok, system="sys")
    prompt, messages = conv.prompt_for(_turn(("user", "hi")))
    expected = tok.encode_chat([{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}])
    assert prompt == expected and messages == [{"role": "user", "content": "hi"}]


def test_split_utf8_output_keeps_its_exact_tokens(tok: Tokenizer) -> None:
    conv = Conversation(tok, system="sys")
    prompt, messages = conv.prompt_for(_turn(("user", "price?")))
    euro = tok.encode("€", add_special_tokens=False)
    assert len(euro) == 3  # byte-level: one token per UTF-8 byte
    output = tok.encode("costs ", add_special_tokens=False) + euro[:2]  # stopped mid-character
    text = tok.decode(output, skip_special_tokens=False)
    assert tok.encode(text, add_special_tokens=False) != output  # re-tokenizing would not give it back
    conv.commit(False, prompt, messages, output, text, exact=True)
    nxt, _ = conv.prompt_for(_turn(("tool", "42")))
    assert nxt[: len(prompt) + len(output)] == prompt + output
    tail = conv.render(conv.messages + [{"role": "tool", "content": "42"}], True)[len(conv.exact_text) :]
    assert nxt[len(prompt) + len(output) :] == tok.encode(tail, add_special_tokens=False)


def test_reply_cut_by_a_stop_string_is_re_tokenized(tok: Tokenizer) -> None:
    conv = Conversation(tok)
    prompt, messages = conv.prompt_for(_turn(("user", "count")))
    output = tok.encode("one two STOP three", add_special_tokens=False)
    conv.commit(False, prompt, messages, output, "one two ", exact=False)
    nxt, msgs = conv.prompt_for(_turn(("user", "more")))
    assert conv.exact_text is None
    assert nxt == tok.encode_chat([*msgs], None)


def test_raw_mode_starts_after_the_system_prompt_and_keeps_output(tok: Tokenizer) -> None:
    conv = Conversation(tok, system="sys")
    system = tok.encode_chat([{"role": "system", "content": "sys"}], add_generation_prompt=False)
    prompt, messages = conv.prompt_for(_turn(token_ids=[5, 6]))
    assert prompt == system + [5, 6]
    conv.commit(True, prompt, messages, [7, 8], "", exact=True)
    nxt, _ = conv.prompt_for(_turn(token_ids=[9]))
    assert nxt == system + [5, 6, 7, 8, 9]
    with pytest.raises(ProtocolError, match="cannot mix"):
        conv.prompt_for(_turn(("user", "hi")))


def test_the_text_a_turn_tokenizes_counts_what_is_not_cached_exactly(tok: Tokenizer) -> None:
    """The off-the-loop rule's measure: a 100 kB system prompt is tokenized with the first turn (and with every
    turn while nothing exact is cached), the tool calls of a message too; after an exact commit only the new text."""
    conv = Conversation(tok, system="s" * 100_000)
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": "y" * 1000}}}
    first = Turn(req=1, session=1, messages=[Message("user", "hi"), Message("assistant", "", tool_calls=[call])])
    assert conv.text_to_tokenize(first) > 101_000
    prompt, messages = conv.prompt_for(_turn(("user", "hi")))
    conv.commit(False, prompt, messages, tok.encode("ok", add_special_tokens=False), "ok", exact=True)
    assert conv.text_to_tokenize(_turn(("user", "more"))) == 4
    raw = Conversation(tok, system="s" * 100_000)
    assert raw.text_to_tokenize(_turn(token_ids=[1, 2])) >= 100_000


def test_an_empty_system_prompt_is_rendered_and_none_is_not(tok: Tokenizer) -> None:
    empty, absent = Conversation(tok, system=""), Conversation(tok)
    user = {"role": "user", "content": "hi"}
    assert empty.prompt_for(_turn(("user", "hi")))[0] == tok.encode_chat([{"role": "system", "content": ""}, user])
    assert absent.prompt_for(_turn(("user", "hi")))[0] == tok.encode_chat([user])
    assert empty.system_tokens() == tok.encode_chat([{"role": "system", "content": ""}], add_generation_prompt=False)
    assert absent.system_tokens() == []
