"""Built-in models ``tiny`` and ``bench``: Qwen2 checkpoints with deterministic random weights.

Written on first use to ``<cache>/<name>-v1`` as a normal Hugging Face checkpoint folder
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json),
so they go through the same loader as a downloaded model.  The folder is built in a temporary
sibling and renamed into place, so two processes racing to create it both end up with one
complete folder.  Same name and version → byte-identical files.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from agentserve import configs
from agentserve.executor.builtin_template import CHAT_TEMPLATE
from agentserve.executor.errors import CheckpointError

VERSION = "v1"
SEED = 1234
CACHE_ENV = "AGENTSERVE_CACHE_DIR"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOOL_TOKENS = ("<tool_call>", "</tool_call>")  # added but not special: they survive skip_special_tokens
ENDOFTEXT, IM_START, IM_END = 256, 257, 258
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


@dataclass(frozen=True)
class BuiltinSpec:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool


BUILTINS: dict[str, BuiltinSpec] = {
    "tiny": BuiltinSpec(128, 2, 4, 2, 352, 4096, tie_word_embeddings=True),
    "bench": BuiltinSpec(512, 8, 8, 2, 1408, 8192, tie_word_embeddings=False),
}


def vocab_size() -> int:
    """256 byte tokens + the added tokens, rounded up to a multiple of 64."""
    n = 256 + len(SPECIAL_TOKENS) + len(TOOL_TOKENS)
    return -(-n // 64) * 64


def default_cache_dir() -> Path:
    return configs.cache_dir(CACHE_ENV, "models")


def resolve_model(name_or_path: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """A checkpoint folder for ``name_or_path``: a built-in name (created if needed) or a directory."""
    if name_or_path in BUILTINS:
        return ensure_builtin(name_or_path, cache_dir)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{path} is not a checkpoint folder: it has no config.json")
        return path
    if path.exists():
        raise CheckpointError(f"model {name_or_path!r} is a file; expected a checkpoint folder")
    raise CheckpointError(
        f"unknown model {name_or_path!r}: not a checkpoint folder and not a built-in model "
        f"({', '.join(BUILTINS)})"
    )


def ensure_builtin(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Create the built-in model folder if it is missing; return its path."""
    if name not in BUILTINS:
        raise CheckpointError(f"no built-in model named {name!r} (have: {', '.join(BUILTINS)})")
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    final = root / f"{name}-{VERSION}"
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-{VERSION}-", dir=root))
    try:
        write_checkpoint(tmp, BUILTINS[name])
        _make_readable(tmp)
        try:
            os.rename(tmp, final)  # atomic; fails if another process got there first
        except OSError:
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _make_readable(folder: Path) -> None:
    """mkdtemp makes a private folder; a shared model cache should be readable by all."""
    folder.chmod(0o755)
    for f in folder.iterdir():
        f.chmod(0o644)


def write_checkpoint(folder: Path, spec: BuiltinSpec) -> None:
    from agentserve.executor.builtin_weights import save_weights

    save_weights(folder / "model.safetensors", spec, vocab_size(), SEED)
    _write_json(folder / "config.json", model_config(spec))
    _write_json(folder / "generation_config.json", {
        "bos_token_id": ENDOFTEXT,
        "eos_token_id": [IM_END, ENDOFTEXT],
        "pad_token_id": ENDOFTEXT,
        "do_sample": False,
    })
    _write_json(folder / "tokenizer_config.json", tokenizer_config())
    build_tokenizer().save(str(folder / "tokenizer.json"))


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def model_config(spec: BuiltinSpec) -> dict:
    """``config.json`` as a Qwen2.5 checkpoint writes it."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "max_position_embeddings": spec.max_position_embeddings,
        "max_window_layers": spec.num_layers,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "sliding_window": None,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": vocab_size(),
        "bos_token_id": ENDOFTEXT,
        "eos_token_id": IM_END,
    }


def tokenizer_config() -> dict:
    added = {}
    for i, tok in enumerate(SPECIAL_TOKENS + TOOL_TOKENS):
        added[str(256 + i)] = {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": tok in SPECIAL_TOKENS,
        }
    return {
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
    }


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable-character map used by byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def build_tokenizer():  # -> tokenizers.Tokenizer
    """Byte-level BPE with no merges: token id ``b`` is byte ``b``; added tokens follow at 256.

    Normaliser and pre-tokeniser are Qwen2's (NFC, its split regex), so transformers' Qwen2Tokenizer
    (which rebuilds those parts itself) and the ``tokenizers`` file agree token for token.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    byte_chars = _bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return tok
