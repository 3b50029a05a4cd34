"""Tokenisation for the orchestrator (torch-free): a checkpoint folder's tokenizer and chat template.

Reads ``tokenizer.json`` (the ``tokenizers`` library does the work), ``tokenizer_config.json``
(chat template, named special tokens), ``chat_template.jinja`` when present, and
``generation_config.json`` / ``config.json`` for the eos ids.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from agentserve.orchestrator.text import chat_template
from agentserve.orchestrator.text.detokenizer import IncrementalDetokenizer
from agentserve.orchestrator.text.stop_strings import StopMatch, StopStringMatcher, find_stop
from agentserve.orchestrator.text.tool_formats import ToolCallFormat, format_for_template

__all__ = [
    "IncrementalDetokenizer",
    "StopMatch",
    "StopStringMatcher",
    "Tokenizer",
    "TokenizerError",
    "find_stop",
]

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


GIL_FREE_ENCODE_CHARS = 4096  # longer texts are encoded without holding the GIL (a worker thread's texts)

BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens (Llama, Mistral, ...)


class TokenizerError(ValueError):
    """A tokenizer file is missing or malformed."""


def _read_json(path: Path, required: bool = False) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise TokenizerError(f"missing {path.name} in {path.parent}")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character → byte: printable Latin-1 bytes stand for themselves, the others
    for U+0100, U+0101, ... in byte order."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    moved = [b for b in range(256) if b not in kept]
    return {chr(b): b for b in kept} | {chr(0x100 + i): b for i, b in enumerate(moved)}


def _chat_templates(folder: Path, config: dict[str, Any]) -> dict[str, str]:
    raw = config.get("chat_template")
    templates: dict[str, str] = {}
    if isinstance(raw, str):
        templates["default"] = raw
    elif isinstance(raw, list):
        templates = {t["name"]: t["template"] for t in raw if isinstance(t, dict) and "name" in t}
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    return templates


class Tokenizer:
    """Encode / decode / chat-template for one checkpoint folder."""

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        special_tokens: dict[str, str],
        chat_templates: dict[str, str],
        eos_token_ids: list[int],
    ) -> None:
        self._tok = tokenizer
        self.folder: Path | None = None  # the checkpoint folder (from_dir)
        self.special_tokens = special_tokens
        self.chat_templates = chat_templates
        self.eos_token_ids = eos_token_ids

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        folder = Path(path)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(f"missing tokenizer.json in {folder}")
        try:
            tok = _HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises a bare Exception
            raise TokenizerError(f"{tok_file} is not a valid tokenizer file: {e}") from None
        config = _read_json(folder / "tokenizer_config.json")
        legacy = _read_json(folder / "special_tokens_map.json")
        special = {
            n: t
            for n in SPECIAL_TOKEN_NAMES
            if (t := _token_text(config.get(n, legacy.get(n)))) is not None
        }
        eos_ids = cls._eos_ids(folder, tok, special.get("eos_token"))
        made = cls(tok, special, _chat_templates(folder, config), eos_ids)
        made.folder = folder
        return made

    @staticmethod
    def _eos_ids(folder: Path, tok: _HFTokenizer, eos_token: str | None) -> list[int]:
        ids: list[int] = []
        if eos_token is not None and (i := tok.token_to_id(eos_token)) is not None:
            ids.append(i)
        gen = _as_id_list(_read_json(folder / "generation_config.json").get("eos_token_id"))
        cfg = _as_id_list(_read_json(folder / "config.json").get("eos_token_id"))
        for i in gen or cfg:
            if i not in ids:
                ids.append(i)
        return ids

    @property
    def vocab_size(self) -> int:
        """Number of tokens the tokenizer knows (the model's vocab may be padded beyond it)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def _byte_level(self) -> dict[str, int] | None:
        """The byte-level alphabet when the decoder maps pieces through it (GPT-2, Llama 3, Qwen), else None."""
        decoder = self._tok.decoder
        state = json.loads(decoder.__getstate__()) if decoder is not None else {}
        kinds = {d.get("type") for d in [state, *state.get("decoders", [])]}
        return _byte_level_alphabet() if "ByteLevel" in kinds else None

    @functools.cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self._tok.get_added_tokens_decoder())

    def token_bytes(self, token_id: int) -> bytes:
        """One token's raw bytes: a byte-level or ``<0xNN>`` piece's own (part of a character where its decoding
        reads U+FFFD); an added token's or any other piece's decoding as UTF-8; none for an id it does not know."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id not in self._added_ids:
            if byte := BYTE_FALLBACK.fullmatch(piece):
                return bytes([int(byte[1], 16)])
            alphabet = self._byte_level
            if alphabet is not None and all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    @functools.cached_property
    def tool_call_format(self) -> ToolCallFormat:
        """How this checkpoint's chat template teaches the model to write tool calls."""
        source = self.chat_templates.get("tool_use") or self.chat_templates.get("default") or ""
        return format_for_template(source)

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > GIL_FREE_ENCODE_CHARS:  # the batch call releases the GIL (the single one holds it)
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render a conversation to text (as ``transformers`` does with ``tokenize=False``)."""
        source = chat_template.select_template(self.chat_templates, tools)
        return chat_template.render(
            source,
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens,
            **kwargs,
        )

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> list[int]:
        """Render and encode a conversation; the template supplies the special tokens itself."""
        text = self.apply_chat_template(messages, tools, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.decode, skip_special_tokens=skip_special_tokens)
