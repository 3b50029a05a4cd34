"""Our tokenizer against transformers' AutoTokenizer on the same folders."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentserve.orchestrator.text.tokenization import Tokenizer, TokenizerError

PIECES = ["<|im_start|>", "<tool_call>", "<|eot_id|>", " ", "\n", "  ", "'s", "e\u0301"]
TEXT = st.lists(st.one_of(st.text(st.characters(codec="utf-8"), max_size=6), st.sampled_from(PIECES)),
                max_size=10).map("".join)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module", params=["tiny", "llama_style"])
def pair(request, tiny_dir, llama_style_dir, hf_tiny_tokenizer, hf_llama_style_tokenizer):
    if request.param == "tiny":
        return Tokenizer.from_dir(tiny_dir), hf_tiny_tokenizer
    return Tokenizer.from_dir(llama_style_dir), hf_llama_style_tokenizer


@SETTINGS
@given(text=TEXT, special=st.booleans())
def test_encode_matches_transformers(pair, text, special):
    ours, theirs = pair
    assert ours.encode(text, add_special_tokens=special) == theirs.encode(text, add_special_tokens=special)


@SETTINGS
@given(text=TEXT, skip=st.booleans())
def test_decode_matches_transformers(pair, text, skip):
    ours, theirs = pair
    ids = theirs.encode(text)
    assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)


def test_llama_style_adds_bos(llama_style_dir):
    tok = Tokenizer.from_dir(llama_style_dir)
    assert tok.encode("hi")[0] == tok.token_to_id("<|begin_of_text|>")
    assert tok.encode("hi", add_special_tokens=False)[0] != tok.token_to_id("<|begin_of_text|>")
    assert tok.bos_token == "<|begin_of_text|>"


def test_eos_ids_join_tokenizer_and_generation_config(tiny_dir, llama_style_dir):
    assert Tokenizer.from_dir(tiny_dir).eos_token_ids == [258, 256]  # <|im_end|>, then <|endoftext|>
    assert Tokenizer.from_dir(llama_style_dir).eos_token_ids == [4, 1]


def test_builtin_tokens_are_bytes(tiny_dir):
    tok = Tokenizer.from_dir(tiny_dir)
    assert tok.encode("hé") == [ord("h"), 0xC3, 0xA9]
    assert tok.encode("<|im_start|><tool_call>") == [257, 259]
    assert tok.decode([257, 104, 259], skip_special_tokens=True) == "h<tool_call>"  # tool tags survive


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(TokenizerError, match="missing tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_corrupt_tokenizer_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not a valid tokenizer"):
        Tokenizer.from_dir(tmp_path)


def test_corrupt_tokenizer_config(tiny_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((tiny_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(TokenizerError, match="JSON object"):
        Tokenizer.from_dir(tmp_path)


def test_orchestrator_side_stays_torch_free(tiny_dir):
    """The orchestrator tokenises, detokenises, parses tool calls and may create built-in models: no torch."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from agentserve.orchestrator.text import tokenization, tool_calls, stop_strings, detokenizer, chat_template\n"
        "from agentserve.executor import builtin\n"
        "from agentserve.protocol import stopping\n"
        "from agentserve.cli import prompts\n"
        f"t = tokenization.Tokenizer.from_dir({str(tiny_dir)!r})\n"
        "t.apply_chat_template([{'role': 'user', 'content': 'x'}])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
