"""Streaming detokenisation never emits half a UTF-8 character and loses nothing."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentserve.orchestrator.text.detokenizer import REPLACEMENT, IncrementalDetokenizer
from agentserve.orchestrator.text.tokenization import Tokenizer

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tiny_tok(tiny_dir):
    return Tokenizer.from_dir(tiny_dir)


@pytest.fixture(scope="module")
def llama_tok(llama_style_dir):
    return Tokenizer.from_dir(llama_style_dir)


def stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    detok = tok.detokenizer()
    deltas = [detok.add(i) for i in ids]
    return [*deltas, detok.flush()]


@SETTINGS
@given(text=st.text(st.characters(codec="utf-8"), max_size=30))
def test_valid_text_streams_without_replacement_chars(tiny_tok, llama_tok, text):
    for tok in (tiny_tok, llama_tok):
        ids = tok.encode(text, add_special_tokens=False)
        deltas = stream(tok, ids)
        assert "".join(deltas) == tok.decode(ids)
        if REPLACEMENT not in text:
            assert all(REPLACEMENT not in d for d in deltas)


@SETTINGS
@given(ids=st.lists(st.integers(0, 260), max_size=40))
def test_arbitrary_bytes_concatenate_to_full_decode(tiny_tok, ids):
    """Random byte tokens (invalid UTF-8 included): the stream still equals the one-shot decode."""
    deltas = stream(tiny_tok, ids)
    assert "".join(deltas) == tiny_tok.decode(ids)


@SETTINGS
@given(text=st.text(st.characters(codec="utf-8", min_codepoint=0x80, exclude_characters=REPLACEMENT),
                    min_size=1, max_size=10))
def test_multibyte_chars_wait_for_their_last_byte(tiny_tok, text):
    ids = tiny_tok.encode(text, add_special_tokens=False)  # one token per byte
    detok = tiny_tok.detokenizer()
    emitted = ""
    for i, t in enumerate(ids):
        emitted += detok.add(t)
        complete = bytes(ids[: i + 1]).decode("utf-8", errors="ignore")
        assert emitted == complete  # exactly the complete characters so far, never a partial one
    assert detok.flush() == ""


def test_skip_special_tokens_and_keep_them(tiny_tok):
    ids = [257, *b"hi", 258]
    assert "".join(stream(tiny_tok, ids)) == "hi"
    detok = IncrementalDetokenizer(tiny_tok.decode, skip_special_tokens=False)
    assert detok.add_many(ids) + detok.flush() == "<|im_start|>hi<|im_end|>"


def test_flush_emits_incomplete_tail(tiny_tok):
    detok = tiny_tok.detokenizer()
    assert detok.add_many([ord("a"), 0xE2, 0x82]) == "a"
    assert detok.flush() == REPLACEMENT
    assert detok.text == "a" + REPLACEMENT
