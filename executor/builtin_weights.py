"""Deterministic random weights for the built-in Qwen2 models, saved as bf16 safetensors (torch-free).

Initialised like transformers does (linear and embedding weights ~ N(0, 0.02), norms = 1), except
that the q/k/v biases are also drawn from N(0, 0.02) rather than zero so the bias path is exercised.
Tensors are drawn from one seeded numpy PCG64 generator in a fixed order and rounded to bf16
(round-to-nearest-even, as ``torch.Tensor.to(torch.bfloat16)`` does), so the bytes never change.
No torch here: the orchestrator process (``agentserve up``) may create the built-in models.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from agentserve.executor.builtin import BuiltinSpec

STD = 0.02


def weight_shapes(spec: BuiltinSpec, vocab: int) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names → shapes, in generation order."""
    h, inter = spec.hidden_size, spec.intermediate_size
    head_dim = h // spec.num_heads
    q, kv = spec.num_heads * head_dim, spec.num_kv_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.q_proj.bias": (q,),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    shapes["model.norm.weight"] = (h,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, h)
    return shapes


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp32 → bf16 bit patterns (uint16), rounding to nearest even. ``x`` must be finite."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    return ((bits + rounding) >> 16).astype(np.uint16)


def make_weights(spec: BuiltinSpec, vocab: int, seed: int) -> dict[str, np.ndarray]:
    """Name → bf16 bit patterns (uint16 arrays of the tensor's shape)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    out: dict[str, np.ndarray] = {}
    for name, shape in weight_shapes(spec, vocab).items():
        if name.endswith("norm.weight"):
            values = np.ones(shape, dtype=np.float32)
        else:
            values = rng.standard_normal(shape, dtype=np.float32) * np.float32(STD)
        out[name] = to_bf16_bits(values)
    return out


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str = "BF16") -> None:
    """The safetensors format: u64 header length, JSON header (offsets into the data), raw data."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for name in sorted(tensors):
            f.write(np.ascontiguousarray(tensors[name]).astype("<u2", copy=False).tobytes())


def save_weights(path: Path, spec: BuiltinSpec, vocab: int, seed: int) -> None:
    write_safetensors(path, make_weights(spec, vocab, seed))
