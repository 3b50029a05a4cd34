"""``agentserve generate --model DIR`` on random-weight checkpoints saved by transformers (no tokenizer
in the folder, as ``save_pretrained`` leaves it) gives transformers' greedy tokens, for each family."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from click.testing import CliRunner

from agentserve.cli.main import main

COMMON = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=300, max_position_embeddings=512, initializer_range=0.2,
              eos_token_id=299)
FAMILIES = {
    "llama3": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}, tie_word_embeddings=False)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=32, tie_word_embeddings=False)),
}
PROMPTS = [[5, 17, 42], [7] * 3 + list(range(100, 130))]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_cli_greedy_matches_transformers(tmp_path, family):
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(**COMMON, **extra)).eval()
    if family == "qwen2":
        for layer in model.model.layers:  # transformers zero-inits biases; make the bias path matter
            torch.nn.init.normal_(layer.self_attn.q_proj.bias, std=0.2)
    model.save_pretrained(tmp_path)
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS))
    result = CliRunner().invoke(main, ["generate", "--model", str(tmp_path), "--prompts-file", str(f),
                                       "--max-tokens", "24", "--ignore-eos", "--dtype", "float32", "--json",
                                       "--chunk-size", "7"])
    assert result.exit_code == 0, result.output
    outs = [json.loads(line) for line in result.stdout.splitlines()]
    model.generation_config.eos_token_id = None  # = --ignore-eos (min_new_tokens would mask eos instead)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                  pad_token_id=0)[0, len(prompt):].tolist()
        assert len(want) == 24
        assert out["token_ids"] == want
        assert out["text"] == ""  # no tokenizer in the folder
    no_tok = CliRunner().invoke(main, ["generate", "--model", str(tmp_path), "--prompt-ids", "1,2", "--stop", "x"])
    assert no_tok.exit_code == 2 and "stop strings need a tokenizer" in no_tok.stderr
    text = CliRunner().invoke(main, ["generate", "--model", str(tmp_path), "--prompt", "hi"])
    assert text.exit_code == 2 and "missing tokenizer.json" in text.stderr
