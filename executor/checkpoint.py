"""Reading a local Hugging Face checkpoint folder: ``config.json`` (+ ``generation_config.json``) and
single or sharded ``*.safetensors``.

Config parsing is torch-free (the orchestrator reads eos ids and the context length from it);
:func:`load_weights` imports torch lazily.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentserve.executor.errors import CheckpointError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
ROPE_TYPES = ("default", "llama3", "linear")
ROPE_FIELDS = {"linear": ("factor",),  # the numbers each scaling needs, each > 0
               "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
_WARNED_SLIDING: set[Path] = set()
POSITIVE_FIELDS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size")
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class ModelConfig:
    """The subset of a checkpoint's ``config.json`` the engine needs, normalised across families."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None for plain RoPE; else includes "rope_type"
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 always; Llama/Qwen3 when attention_bias
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before RoPE
    max_position_embeddings: int
    torch_dtype: str | None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _read_json(path: Path, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise CheckpointError(f"missing {path.name} in checkpoint folder {path.parent}")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"corrupt {path}: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"corrupt {path}: expected a JSON object")
    return data


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _rope(raw: dict[str, Any], path: Path) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from the v5 ``rope_parameters`` or the v4 ``rope_theta`` + ``rope_scaling`` keys."""
    params = raw.get("rope_parameters") or {}
    scaling = dict(raw.get("rope_scaling") or params)
    theta = float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(
            f"{path}: unsupported rope type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})"
        )
    if rope_type == "default":
        return theta, None
    scaling["rope_type"] = rope_type
    scaling.pop("type", None)
    scaling.pop("rope_theta", None)
    for name in ROPE_FIELDS[rope_type]:
        value = scaling.get(name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and value > 0):
            raise CheckpointError(f"{path}: rope scaling {rope_type!r} needs {name}, a number > 0; got {value!r}")
        scaling[name] = float(value)
    if rope_type == "llama3" and scaling["low_freq_factor"] == scaling["high_freq_factor"]:
        raise CheckpointError(f"{path}: rope scaling 'llama3' needs low_freq_factor != high_freq_factor")
    return theta, scaling


def _architecture(raw: dict[str, Any], path: Path) -> str:
    archs = raw.get("architectures") or []
    if isinstance(archs, str):  # one name where a list was due: read as that list
        archs = [archs]
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch
    raise CheckpointError(
        f"{path}: unsupported architecture {', '.join(map(str, archs)) or '(none given)'}; "
        f"supported: {', '.join(ARCHITECTURES)}"
    )


def load_config(model_dir: str | Path) -> ModelConfig:
    """Parse ``config.json`` and ``generation_config.json`` of a checkpoint folder."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"checkpoint folder {model_dir} does not exist")
    path = model_dir / "config.json"
    raw = _read_json(path, required=True)
    gen = _read_json(model_dir / "generation_config.json", required=False) or {}
    arch = _architecture(raw, path)
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{path}: unsupported hidden_act {raw['hidden_act']!r} (only silu)")
    if raw.get("use_sliding_window") and path not in _WARNED_SLIDING:  # once per folder, however often it is read
        _WARNED_SLIDING.add(path)
        log.warning("%s: sliding-window attention is not implemented; using full attention", path)
    try:
        for name in POSITIVE_FIELDS:
            if int(raw[name]) < 1:
                raise CheckpointError(f"{path}: {name} must be >= 1, got {raw[name]!r}")
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        theta, scaling = _rope(raw, path)
        bias = bool(raw.get("attention_bias", False))
        eos = list(dict.fromkeys(_id_list(raw.get("eos_token_id")) + _id_list(gen.get("eos_token_id"))))
        return ModelConfig(
            architecture=arch,
            hidden_size=hidden,
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            intermediate_size=int(raw["intermediate_size"]),
            vocab_size=int(raw["vocab_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bias,
            o_bias=arch != "Qwen2ForCausalLM" and bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            eos_token_ids=tuple(eos),
            bos_token_id=raw.get("bos_token_id", gen.get("bos_token_id")),
            extra=raw,
        )
    except KeyError as e:
        raise CheckpointError(f"{path}: missing required field {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: invalid value: {e}") from e


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: those named by the index file, else ``*.safetensors``."""
    model_dir = Path(model_dir)
    index = _read_json(model_dir / INDEX_FILE, required=False)
    if index is not None:
        names = sorted(set((index.get("weight_map") or {}).values()))
        if not names:
            raise CheckpointError(f"{model_dir / INDEX_FILE}: empty weight_map")
        files = [model_dir / n for n in names]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"missing weight shard {f.name} (named in {INDEX_FILE}) in {model_dir}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weight files in checkpoint folder {model_dir}")
    return files


def load_weights(model_dir: str | Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint by its Hugging Face name (``model.layers.0.self_attn.q_proj.weight``)."""
    from safetensors import SafetensorError, safe_open

    weights: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        try:
            with safe_open(str(path), framework="pt", device=device) as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    weights[name] = f.get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"corrupt weight file {path}: {e}") from e
    return weights
