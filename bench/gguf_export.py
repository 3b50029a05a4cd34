"""Write a Qwen2 checkpoint (the built-in ``tiny``/``bench`` models) as GGUF for llama.cpp's server.

Writes the file with the ``gguf`` package directly instead of llama.cpp's ``convert_hf_to_gguf.py``,
which needs ``sentencepiece`` and rejects our byte-level BPE's unknown pre-tokenizer hash. Matrices
keep the checkpoint's bf16; norms and biases are f32 as llama.cpp expects. The vocabulary is the
byte-level one of the built-in tokenizer (token id b = byte b, added tokens after), padded to the
embedding size with unused entries. The benchmark sends token ids, so text tokenisation (BPE merges,
pre-tokenizer) never runs; llama.cpp still demands a merges array, so it gets one harmless merge.

    python -m agentserve.bench.gguf_export --model bench --out bench.gguf
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's tensor name for a Hugging Face Qwen2 tensor name."""
    if hf_name in TOP_NAMES:
        return TOP_NAMES[hf_name]
    prefix, _, rest = hf_name.partition(".layers.")
    index, _, leaf = rest.partition(".")
    if prefix != "model" or leaf not in LAYER_NAMES:
        raise KeyError(f"no GGUF name for tensor {hf_name!r}")
    return f"blk.{int(index)}.{LAYER_NAMES[leaf]}"


def vocab_entries(tokenizer_json: dict, vocab_size: int):
    """(tokens, token types) for ``vocab_size`` ids from a ``tokenizer.json`` (byte-level BPE)."""
    from gguf import TokenType

    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [TokenType.UNUSED] * vocab_size
    for text, i in tokenizer_json["model"]["vocab"].items():
        tokens[i], types[i] = text, TokenType.NORMAL
    for added in tokenizer_json.get("added_tokens", []):
        i = added["id"]
        tokens[i] = added["content"]
        types[i] = TokenType.CONTROL if added.get("special") else TokenType.USER_DEFINED
    return tokens, [int(t) for t in types]


def _tensor(writer, name: str, t) -> None:
    import torch
    from gguf import GGMLQuantizationType

    if t.dim() == 1:  # norms and biases: f32
        writer.add_tensor(name, t.to(torch.float32).numpy())
    else:
        raw = t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=GGMLQuantizationType.BF16)


def export(checkpoint: Path, out: Path) -> Path:
    """Write ``checkpoint`` (a Qwen2 HF folder) as a GGUF file at ``out``."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((checkpoint / "config.json").read_text())
    if cfg.get("model_type") != "qwen2":
        raise ValueError(f"only qwen2 checkpoints are supported, got {cfg.get('model_type')!r}")
    tok = json.loads((checkpoint / "tokenizer.json").read_text())
    gen = json.loads((checkpoint / "generation_config.json").read_text()) \
        if (checkpoint / "generation_config.json").is_file() else {}
    tensors = load_file(str(checkpoint / "model.safetensors"))
    if "lm_head.weight" not in tensors:  # tied embeddings
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]

    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(out), "qwen2")
    w.add_name(checkpoint.name)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg.get("rope_theta", 1000000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])

    tokens, types = vocab_entries(tok, cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["Ġ t"])  # never used: prompts are token ids; llama.cpp needs a non-empty list
    eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
    w.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    if cfg.get("bos_token_id") is not None:
        w.add_bos_token_id(cfg["bos_token_id"])
    if gen.get("pad_token_id") is not None:
        w.add_pad_token_id(gen["pad_token_id"])
    w.add_add_bos_token(False)

    for name, t in tensors.items():
        _tensor(w, gguf_name(name), t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bench", help="built-in model name or checkpoint folder")
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args(argv)
    from agentserve.executor.builtin import resolve_model

    print(export(resolve_model(args.model), args.out))


if __name__ == "__main__":
    main()
