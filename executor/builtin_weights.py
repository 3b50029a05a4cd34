"""Deterministic random weights for the built-in Qwen2 models, saved as bf16 safetensors.

Initialised like transformers does (linear and embedding weights ~ N(0, 0.02), norms = 1), except
that the q/k/v biases are also drawn from N(0, 0.02) rather than zero so the bias path is exercised.
Tensors are drawn from one seeded CPU generator in a fixed order, so the bytes never change.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

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


def make_weights(spec: BuiltinSpec, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in weight_shapes(spec, vocab).items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape)
        else:
            t = torch.randn(shape, generator=gen, dtype=torch.float32) * STD
        out[name] = t.to(torch.bfloat16).contiguous()
    return out


def save_weights(path: Path, spec: BuiltinSpec, vocab: int, seed: int) -> None:
    save_file(make_weights(spec, vocab, seed), str(path), metadata={"format": "pt"})
