"""One decoder for Llama, Qwen2 and Qwen3: RMSNorm, RoPE, GQA attention (optional qkv bias, optional q/k
norm), SwiGLU MLP, tied or untied lm_head. Weights are fused at load time (qkv, gate_up)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from agentserve.executor.attention import AttentionBackend
from agentserve.executor.checkpoint import ModelConfig
from agentserve.executor.errors import CheckpointError
from agentserve.executor.kv_cache import KVCache
from agentserve.executor.layers import Rotary, rms_norm, silu_mul


@dataclass
class Layer:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


class _Weights:
    """Pops tensors from a checkpoint state dict by name, casting them and failing with a clear message."""

    def __init__(self, state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> None:
        self.state, self.dtype, self.device = state, dtype, device

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.state:
            raise CheckpointError(f"checkpoint has no tensor {name!r}")
        t = self.state.pop(name)
        if tuple(t.shape) != shape:
            raise CheckpointError(f"tensor {name!r} has shape {tuple(t.shape)}, config implies {shape}")
        return t.to(device=self.device, dtype=self.dtype)

    def fused(self, names: list[str], shapes: list[tuple[int, ...]]) -> torch.Tensor:
        return torch.cat([self.take(n, s) for n, s in zip(names, shapes, strict=True)], dim=0).contiguous()

    def maybe_fused(self, want: bool, names: list[str], shapes: list[tuple[int, ...]]) -> torch.Tensor | None:
        return self.fused(names, shapes) if want else None


class DecoderModel:
    """Weights plus a forward pass over a flat batch of tokens whose attention is described by ``meta``."""

    def __init__(
        self,
        config: ModelConfig,
        state: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
    ) -> None:
        self.config = config
        w = _Weights(state, dtype, device)
        c = config
        self.embed = w.take("model.embed_tokens.weight", (c.vocab_size, c.hidden_size))
        self.layers = [self._layer(w, i) for i in range(c.num_layers)]
        self.norm = w.take("model.norm.weight", (c.hidden_size,))
        if c.tie_word_embeddings:
            state.pop("lm_head.weight", None)
            self.lm_head = self.embed
        else:
            self.lm_head = w.take("lm_head.weight", (c.vocab_size, c.hidden_size))
        self.rotary = Rotary(c.head_dim, c.rope_theta, c.rope_scaling, max_positions, dtype, device)

    def _layer(self, w: _Weights, i: int) -> Layer:
        c, p = self.config, f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        qkv_names = [a + "q_proj", a + "k_proj", a + "v_proj"]
        qkv_rows = [c.q_size, c.kv_size, c.kv_size]
        inter = c.intermediate_size
        return Layer(
            input_norm=w.take(p + "input_layernorm.weight", (c.hidden_size,)),
            qkv=w.fused([n + ".weight" for n in qkv_names], [(r, c.hidden_size) for r in qkv_rows]),
            qkv_bias=w.maybe_fused(c.qkv_bias, [n + ".bias" for n in qkv_names], [(r,) for r in qkv_rows]),
            q_norm=w.take(a + "q_norm.weight", (c.head_dim,)) if c.qk_norm else None,
            k_norm=w.take(a + "k_norm.weight", (c.head_dim,)) if c.qk_norm else None,
            o=w.take(a + "o_proj.weight", (c.hidden_size, c.q_size)),
            o_bias=w.take(a + "o_proj.bias", (c.hidden_size,)) if c.o_bias else None,
            post_norm=w.take(p + "post_attention_layernorm.weight", (c.hidden_size,)),
            gate_up=w.fused([m + "gate_proj.weight", m + "up_proj.weight"], [(inter, c.hidden_size)] * 2),
            gate_up_bias=w.maybe_fused(
                c.mlp_bias, [m + "gate_proj.bias", m + "up_proj.bias"], [(inter,)] * 2
            ),
            down=w.take(m + "down_proj.weight", (c.hidden_size, inter)),
            down_bias=w.take(m + "down_proj.bias", (c.hidden_size,)) if c.mlp_bias else None,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        backend: AttentionBackend,
        meta: object,
    ) -> torch.Tensor:
        """Hidden states after the final norm, ``[T, hidden]``, for flat ``input_ids``/``positions`` ([T])."""
        x = F.embedding(input_ids, self.embed)
        cos, sin = self.rotary.tables(positions)
        for i, layer in enumerate(self.layers):
            x = x + self._attention(
                layer,
                rms_norm(x, layer.input_norm, self.config.rms_norm_eps),
                cos,
                sin,
                cache.k[i],
                cache.v[i],
                backend,
                meta,
            )
            h = rms_norm(x, layer.post_norm, self.config.rms_norm_eps)
            x = x + F.linear(
                silu_mul(F.linear(h, layer.gate_up, layer.gate_up_bias)), layer.down, layer.down_bias
            )
        return rms_norm(x, self.norm, self.config.rms_norm_eps)

    def _attention(
        self,
        layer: Layer,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        backend: AttentionBackend,
        meta: object,
    ) -> torch.Tensor:
        c, t = self.config, h.shape[0]
        q, k, v = F.linear(h, layer.qkv, layer.qkv_bias).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.view(t, c.num_heads, c.head_dim)
        k = k.view(t, c.num_kv_heads, c.head_dim)
        if layer.q_norm is not None:
            q = rms_norm(q, layer.q_norm, c.rms_norm_eps)
            k = rms_norm(k, layer.k_norm, c.rms_norm_eps)
        q = self.rotary.apply(q, cos, sin)
        k = self.rotary.apply(k, cos, sin)
        out = backend.forward(q, k, v.view(t, c.num_kv_heads, c.head_dim), k_cache, v_cache, meta)
        return F.linear(out, layer.o, layer.o_bias)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]`` for hidden states ``[N, hidden]``."""
        return F.linear(hidden, self.lm_head).float()
