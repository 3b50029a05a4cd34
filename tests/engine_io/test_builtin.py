"""Built-in models are normal checkpoints (transformers loads them), deterministic, and race-safe."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
import transformers

from agentserve.executor.builtin import BUILTINS, ensure_builtin, model_config, resolve_model, vocab_size
from agentserve.executor.builtin_weights import to_bf16_bits, weight_shapes
from agentserve.executor.errors import CheckpointError


def test_transformers_loads_tiny(tiny_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.vocab_size == vocab_size() == 320
    assert model.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    assert torch.equal(model.model.norm.weight, torch.ones(128))
    std = model.model.layers[1].mlp.up_proj.weight.std().item()
    assert 0.018 < std < 0.022
    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_dir))
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 4)


def test_same_bytes_every_time(tiny_dir, tmp_path):
    again = ensure_builtin("tiny", tmp_path)
    assert again != tiny_dir
    names = sorted(p.name for p in tiny_dir.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]
    for name in names:
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes(), name


def test_second_call_reuses_folder(tiny_dir):
    before = (tiny_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_builtin("tiny", tiny_dir.parent) == tiny_dir
    assert (tiny_dir / "model.safetensors").stat().st_mtime_ns == before


def test_racing_processes_leave_one_complete_folder(tmp_path):
    code = ("import sys; from agentserve.executor.builtin import ensure_builtin; "
            "print(ensure_builtin('tiny', sys.argv[1]), 'torch' in sys.modules)")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert set(outs) == {f"{tmp_path / 'tiny-v1'} False"}  # and torch-free: the orchestrator may call it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-v1"]  # no temp folders left behind
    assert len(list((tmp_path / "tiny-v1").iterdir())) == 5


def test_bench_size():
    cfg = model_config(BUILTINS["bench"])
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["intermediate_size"], cfg["max_position_embeddings"]) == \
        (512, 8, 8, 2, 1408, 8192)
    params = sum(math.prod(s) for s in weight_shapes(BUILTINS["bench"], vocab_size()).values())
    assert 20e6 < params < 45e6


def test_resolve_model(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTSERVE_CACHE_DIR", str(tiny_dir.parent))
    assert resolve_model("tiny") == tiny_dir
    assert resolve_model(str(tiny_dir)) == tiny_dir
    with pytest.raises(CheckpointError, match="unknown model 'nope'"):
        resolve_model("nope")
    with pytest.raises(CheckpointError, match="no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointError, match="is a file"):
        resolve_model(str(tmp_path / "f"))


def test_bf16_rounding_matches_torch():
    x = torch.randn(10000, generator=torch.Generator().manual_seed(0)) * 3
    halfway = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -1.0 - 2**-8, 0.0, -0.0, 1e-40, 3e38])  # ties, subnormal
    x = torch.cat([x, halfway])
    ours = to_bf16_bits(x.numpy())
    assert (ours == x.to(torch.bfloat16).view(torch.int16).numpy().view("uint16")).all()
