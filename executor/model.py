"""One decoder for Llama, Qwen2 and Qwen3: RMSNorm, RoPE, GQA attention (optional qkv bias, optional q/k
norm), SwiGLU MLP, tied or untied lm_head. Weights are fused at load time (qkv, gate_up) and held as
:mod:`.linear` matrices (dense, or packed fp16 on CPU)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from agentserve.executor.attention import AttentionBackend
from agentserve.executor.checkpoint import ModelConfig
from agentserve.executor.errors import CheckpointError
from agentserve.executor.fused.prefill_qkv import PrefillQkv
from agentserve.executor.kv_cache import KVCache
from agentserve.executor.layer_hook import between_layers
from agentserve.executor.layers import Rotary, rms_norm
from agentserve.executor.linear import (
    DenseLinear,
    HybridLinear,
    Linear,
    PackedFp16Linear,
    bf16_forward,
    bf16_rows,
    choose_format,
    gated_mlp,
    input_dtype,
    make_linear,
    residual_product,
)


@dataclass
class Layer:
    input_norm: torch.Tensor
    qkv: Linear  # q, k and v projections fused (with their biases where the model has them)
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # gate and up projections fused
    down: Linear


class _Weights:
    """Pops tensors from a checkpoint state dict by name, casting them and failing with a clear message.

    Matrices become :class:`Linear` objects in the format the ``weights`` setting picks for each (see
    :mod:`.linear`); the choice sees the dtype the checkpoint stored the matrix in."""

    def __init__(self, state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
                 weights: str) -> None:
        self.state, self.dtype, self.device, self.weights = state, dtype, device, weights
        self.formats: set[str] = set()  # the formats of the matrices made

    def raw(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.state:
            raise CheckpointError(f"checkpoint has no tensor {name!r}")
        t = self.state.pop(name)
        if tuple(t.shape) != shape:
            raise CheckpointError(f"tensor {name!r} has shape {tuple(t.shape)}, config implies {shape}")
        return t

    def cast(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.device, dtype=self.dtype)

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self.cast(self.raw(name, shape))

    def linear(self, names: list[str], shapes: list[tuple[int, ...]], bias: bool = False) -> Linear:
        """The matrices ``names`` (``.weight`` appended) fused along rows, with their ``.bias`` if ``bias``."""
        source = torch.cat([self.raw(n + ".weight", s) for n, s in zip(names, shapes, strict=True)])
        b = torch.cat([self.raw(n + ".bias", s[:1]) for n, s in zip(names, shapes, strict=True)]) if bias else None
        return self.as_linear(source.dtype, self.cast(source), None if b is None else self.cast(b))

    def as_linear(self, stored: torch.dtype, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        """``weight`` (in the model dtype; ``stored`` in the checkpoint) as a matrix in its chosen format."""
        fmt = choose_format(self.weights, stored, weight)
        self.formats.add(fmt)
        return make_linear(fmt, weight, bias, stored)


class DecoderModel:
    """Weights plus a forward pass over a flat batch of tokens whose attention is described by ``meta``."""

    def __init__(
        self,
        config: ModelConfig,
        state: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        weights: str = "auto",
    ) -> None:
        self.config = config
        w = _Weights(state, dtype, device, weights)
        c, self.dtype = config, dtype
        self.embed, self.lm_head = self._embedding_and_head(w)
        self.layers = [self._layer(w, i) for i in range(c.num_layers)]
        self.norm = w.take("model.norm.weight", (c.hidden_size,))
        self.weight_formats = sorted(w.formats)
        self.rotary = Rotary(c.head_dim, c.rope_theta, c.rope_scaling, max_positions, dtype, device)
        self.prefill_qkv: PrefillQkv | None = None  # the runner gives it where steps can take it (_fused_qkv_queries)

    def _embedding_and_head(self, w: _Weights) -> tuple[torch.Tensor, Linear]:
        """The lookup table and the lm_head.  The table is shared with a dense tied head; otherwise it is
        kept as stored when that is narrower than the model dtype (a row widened on lookup is exact), so
        a packed head leaves no wide copy of it behind."""
        c = self.config
        stored = w.raw("model.embed_tokens.weight", (c.vocab_size, c.hidden_size))
        wider = stored.is_floating_point() and stored.dtype.itemsize < self.dtype.itemsize
        narrow = stored.to(w.device) if wider else None
        if not c.tie_word_embeddings:
            head = w.linear(["lm_head"], [(c.vocab_size, c.hidden_size)])
            return (w.cast(stored) if narrow is None else narrow), head
        w.state.pop("lm_head.weight", None)
        embed = w.cast(stored)
        head = w.as_linear(stored.dtype, embed, None)
        if isinstance(head, DenseLinear) or narrow is None:
            return embed, head
        if isinstance(head, HybridLinear) and narrow.dtype == head.weight16.dtype:
            head.weight16 = narrow  # the table is the head's bf16 matrix: one copy
        return narrow, head

    def _layer(self, w: _Weights, i: int) -> Layer:
        c, p = self.config, f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        inter = c.intermediate_size
        return Layer(
            input_norm=w.take(p + "input_layernorm.weight", (c.hidden_size,)),
            qkv=w.linear([a + "q_proj", a + "k_proj", a + "v_proj"],
                         [(r, c.hidden_size) for r in (c.q_size, c.kv_size, c.kv_size)], c.qkv_bias),
            q_norm=w.take(a + "q_norm.weight", (c.head_dim,)) if c.qk_norm else None,
            k_norm=w.take(a + "k_norm.weight", (c.head_dim,)) if c.qk_norm else None,
            o=w.linear([a + "o_proj"], [(c.hidden_size, c.q_size)], c.o_bias),
            post_norm=w.take(p + "post_attention_layernorm.weight", (c.hidden_size,)),
            gate_up=w.linear([m + "gate_proj", m + "up_proj"], [(inter, c.hidden_size)] * 2, c.mlp_bias),
            down=w.linear([m + "down_proj"], [(c.hidden_size, inter)], c.mlp_bias),
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        backend: AttentionBackend,
        meta: object,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, ``[T, hidden]``, for flat ``input_ids``/``positions`` ([T]); with
        ``rows``, only those rows' (the final norm is row-wise: the same values, the other rows not normalized)."""
        x = F.embedding(input_ids, self.embed).to(self.dtype)
        cos, sin = self.rotary.tables(positions)
        eps = self.config.rms_norm_eps
        for i, layer in enumerate(self.layers):
            if i:
                between_layers()  # a preempting step may run here, once this forward has done a layer
            x += self._attention(
                layer,
                rms_norm(x, layer.input_norm, eps, input_dtype(layer.qkv)),
                cos,
                sin,
                cache.k[i],
                cache.v[i],
                backend,
                meta,
            )
            h = rms_norm(x, layer.post_norm, eps, input_dtype(layer.gate_up))
            x += gated_mlp(layer.gate_up, layer.down, h)
        return rms_norm(x if rows is None else x[rows], self.norm, eps)

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
        queries = self._fused_qkv_queries(layer, k_cache, backend, meta)
        if queries is not None:  # bitwise the passes below and the backend's casts
            q, k, v = self.prefill_qkv.parts(*self._qkv_inputs(layer, h), cos.squeeze(1), sin.squeeze(1),
                                             torch.get_num_threads(), queries)
        else:
            q, k, v = layer.qkv(h).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            q = q.view(t, c.num_heads, c.head_dim)
            k = k.view(t, c.num_kv_heads, c.head_dim)
            v = v.view(t, c.num_kv_heads, c.head_dim)
            if layer.q_norm is not None:
                q = rms_norm(q, layer.q_norm, c.rms_norm_eps)
                k = rms_norm(k, layer.k_norm, c.rms_norm_eps)
            q = self.rotary.apply(q, cos, sin)
            k = self.rotary.apply(k, cos, sin)
        out = backend.forward(q, k, v, k_cache, v_cache, meta)
        if out.dtype != self.dtype and input_dtype(layer.o) is None:  # bf16 (bf16_forward) for a matrix that widens
            out = out.to(self.dtype)
        return residual_product(layer.o, out)

    def _qkv_inputs(
        self, layer: Layer, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The q, k and v columns of the qkv product as :mod:`.fused.prefill_qkv` reads them, and the bias it adds: a
        hybrid matrix's bf16 product and its bias, a packed fp16 one's fp32 product (its bias included); with q/k norms
        (Qwen3) q and k through them, beside the fp32 product's v — what the passes of :meth:`_attention` rotate."""
        c, t = self.config, h.shape[0]
        if layer.q_norm is not None:
            q, k, v = layer.qkv(h).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            q = rms_norm(q.view(t, c.num_heads, c.head_dim), layer.q_norm, c.rms_norm_eps)
            k = rms_norm(k.view(t, c.num_kv_heads, c.head_dim), layer.k_norm, c.rms_norm_eps)
            return q.view(t, -1), k.view(t, -1), v, None
        hybrid = isinstance(layer.qkv, HybridLinear)
        y, bias = (layer.qkv.bf16_product(h), layer.qkv.bias) if hybrid else (layer.qkv(h), None)
        return (*y.split([c.q_size, c.kv_size, c.kv_size], dim=-1), bias)

    def _fused_qkv_queries(self, layer: Layer, k_cache: torch.Tensor, backend: AttentionBackend,
                           meta: object) -> torch.dtype | None:
        """The dtype of the queries where this layer's q, k and v (fp16) come from :mod:`.fused.prefill_qkv` in one
        pass, else ``None``: over an fp16 cache, where the backend attends every query row in one dtype (bf16:
        PyTorch's bf16 attention; fp32: the compiled prefill kernels) and the qkv product is what the kernel reads — a
        hybrid matrix's bf16 product in a forward that multiplies every row of it in bf16, or a packed fp16 matrix's
        fp32 one under fp32 queries (:meth:`_qkv_inputs`; with q/k norms, those run in PyTorch first)."""
        if self.prefill_qkv is None or k_cache.dtype != torch.float16:
            return None
        queries = backend.prefill_query_dtype(meta)
        if isinstance(layer.qkv, HybridLinear) and bf16_forward():
            return queries if queries in (torch.bfloat16, torch.float32) else None
        return queries if isinstance(layer.qkv, PackedFp16Linear) and queries == torch.float32 else None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]`` for hidden states ``[N, hidden]``: no row in bf16, whatever forward of this
        thread is under way (a preempting step's logits come inside the step it preempts, whose rows are not
        these)."""
        with bf16_rows(None):
            return self.lm_head(hidden).float()
