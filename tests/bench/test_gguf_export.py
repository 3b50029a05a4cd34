"""GGUF export of the built-in Qwen2 model: names, dtypes, values, vocabulary and metadata."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from agentserve.bench.gguf_export import export, gguf_name


def test_tensor_names_follow_llama_cpp():
    assert gguf_name("model.embed_tokens.weight") == "token_embd.weight"
    assert gguf_name("model.layers.3.self_attn.k_proj.bias") == "blk.3.attn_k.bias"
    assert gguf_name("model.layers.0.mlp.down_proj.weight") == "blk.0.ffn_down.weight"
    assert gguf_name("lm_head.weight") == "output.weight"
    with pytest.raises(KeyError):
        gguf_name("model.layers.0.self_attn.rotary_emb.inv_freq")


def test_export_round_trips_the_tiny_model(tmp_path):
    gguf = pytest.importorskip("gguf")
    from safetensors.torch import load_file

    from agentserve.executor.builtin import resolve_model

    ckpt = resolve_model("tiny", cache_dir=tmp_path / "models")
    out = export(ckpt, tmp_path / "tiny.gguf")
    reader = gguf.GGUFReader(str(out))
    fields = {k: v.contents() for k, v in reader.fields.items() if not k.startswith("GGUF.")}
    cfg = json.loads((ckpt / "config.json").read_text())
    assert fields["general.architecture"] == "qwen2"
    assert fields["qwen2.block_count"] == cfg["num_hidden_layers"]
    assert fields["qwen2.attention.head_count_kv"] == cfg["num_key_value_heads"]
    tokens = fields["tokenizer.ggml.tokens"]
    assert len(tokens) == cfg["vocab_size"]
    assert tokens[ord("A")] == "A" and tokens[32] == "Ġ" and tokens[258] == "<|im_end|>"
    assert fields["tokenizer.ggml.eos_token_id"] == 258

    hf = load_file(str(ckpt / "model.safetensors"))
    by_name = {t.name: t for t in reader.tensors}
    assert len(by_name) == len(hf) + (1 if "lm_head.weight" not in hf else 0)
    q = by_name["blk.1.attn_q.weight"]
    assert q.tensor_type == gguf.GGMLQuantizationType.BF16
    want = hf["model.layers.1.self_attn.q_proj.weight"]
    got = torch.from_numpy(np.array(q.data).view(np.int16).copy()).view(torch.bfloat16)
    assert torch.equal(got.reshape(want.shape), want)
    norm = by_name["blk.0.attn_norm.weight"]
    assert norm.tensor_type == gguf.GGMLQuantizationType.F32
    bias = by_name["blk.0.attn_v.bias"]
    assert np.allclose(np.array(bias.data), hf["model.layers.0.self_attn.v_proj.bias"].float().numpy())
