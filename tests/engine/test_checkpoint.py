"""Checkpoint loading: config normalisation, sharded weights, and clear typed errors for bad folders."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
from engine_helpers import build_hf_model, save_checkpoint
from safetensors.torch import load_file, save_file

from agentserve.executor.checkpoint import load_config, load_weights
from agentserve.executor.errors import CheckpointError, EngineError
from agentserve.executor.runner import ModelRunner, PrefillChunk


@pytest.fixture
def ckpt(tmp_path, cases):
    """A private copy of the Qwen3 checkpoint that a test may damage."""
    return shutil.copytree(cases["qwen3_headdim"].path, tmp_path / "ckpt")


def edit_config(path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_config_fields_per_family(cases):
    llama = load_config(cases["llama3_untied"].path)
    assert llama.rope_scaling["rope_type"] == "llama3" and llama.rope_theta == 500000.0
    assert (llama.head_dim, llama.tie_word_embeddings, llama.qkv_bias, llama.qk_norm) == (16, False, False, False)
    qwen2 = load_config(cases["qwen2_tied_bias"].path)
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.tie_word_embeddings, qwen2.rope_scaling) == (True, False, True, None)
    qwen3 = load_config(cases["qwen3_headdim"].path)
    assert (qwen3.head_dim, qwen3.qk_norm, qwen3.num_kv_heads, qwen3.vocab_size) == (32, True, 2, 300)


def test_v4_style_rope_keys_and_eos_merge(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["rope_parameters"], cfg["head_dim"]
    cfg |= {"rope_theta": 1e6, "eos_token_id": [7, 8], "torch_dtype": "bfloat16",
            "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}}
    cfg.pop("dtype", None)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [8, 9]}))
    c = load_config(ckpt)
    assert c.rope_theta == 1e6 and c.rope_scaling["rope_type"] == "llama3"
    assert c.eos_token_ids == (7, 8, 9) and c.torch_dtype == "bfloat16" and c.head_dim == 64 // 4


def test_config_parsing_is_torch_free(cases):
    code = ("import sys; from agentserve.executor.checkpoint import load_config; "
            f"load_config({str(cases['llama_tied'].path)!r}); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sharded_checkpoint_loads_identically(tmp_path, cases):
    case = cases["llama3_untied"]
    sharded = save_checkpoint(case.hf, tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    single, split = load_weights(case.path), load_weights(sharded)
    assert split.keys() == single.keys()
    assert all(torch.equal(split[k], single[k]) for k in single)
    chunk = [PrefillChunk(case.prompts[1], 0, [0, 1])]
    one = ModelRunner(case.path, dtype="float32", device="cpu", num_blocks=4).prefill(chunk)
    many = ModelRunner(sharded, dtype="float32", device="cpu", num_blocks=4).prefill(chunk)
    assert torch.allclose(one, many, rtol=0, atol=1e-6)  # MKL results may differ by alignment


def test_tied_checkpoint_without_lm_head_and_untied_needs_it(tmp_path):
    model = build_hf_model("llama_tied")
    path = save_checkpoint(model, tmp_path / "tied")
    assert "lm_head.weight" not in load_weights(path)
    runner = ModelRunner(path, dtype="float32", device="cpu", num_blocks=2)
    assert runner.model.lm_head.weight is runner.model.embed
    edit_config(path, tie_word_embeddings=False)
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        ModelRunner(path, dtype="float32", device="cpu", num_blocks=2)


def test_unknown_architecture(ckpt):
    edit_config(ckpt, architectures=["GPT2LMHeadModel"])
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel"):
        load_config(ckpt)


def test_missing_config_and_folder(ckpt, tmp_path):
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load_config(ckpt)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_config(tmp_path / "nowhere")


def test_corrupt_config_json(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt .*config.json"):
        load_config(ckpt)


def test_missing_field_and_unsupported_rope(ckpt):
    edit_config(ckpt, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(CheckpointError, match="rope type 'yarn'"):
        load_config(ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["hidden_size"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_config(ckpt)


LLAMA3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.mark.parametrize("changes, says", [
    ({"rope_parameters": {k: v for k, v in LLAMA3.items() if k != "low_freq_factor"}}, "needs low_freq_factor"),
    ({"rope_parameters": LLAMA3 | {"factor": None}}, "needs factor, a number > 0; got None"),
    ({"rope_parameters": LLAMA3 | {"high_freq_factor": 1.0}}, "low_freq_factor != high_freq_factor"),
    ({"rope_scaling": {"type": "linear"}}, "'linear' needs factor"),
    ({"rope_scaling": {"type": "linear", "factor": "four"}}, "needs factor, a number > 0; got 'four'"),
    ({"num_attention_heads": 0}, "num_attention_heads must be >= 1"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be >= 1"),
])
def test_a_config_the_model_cannot_be_built_from_is_named_at_load(ckpt, changes, says):
    """These were a KeyError / TypeError / ZeroDivisionError traceback (at model build, or a decode step's IndexError
    for zero layers) instead of a CheckpointError naming config.json and the field."""
    edit_config(ckpt, **changes)
    with pytest.raises(CheckpointError, match=f"config.json: .*{re.escape(says)}"):
        load_config(ckpt)


def test_architectures_given_as_one_string_is_read_as_that_name(ckpt):
    edit_config(ckpt, architectures="Qwen3ForCausalLM")
    assert load_config(ckpt).architecture == "Qwen3ForCausalLM"
    edit_config(ckpt, architectures="GPT2LMHeadModel")
    with pytest.raises(CheckpointError, match="unsupported architecture GPT2LMHeadModel;"):
        load_config(ckpt)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors(ckpt, damage):
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(b"\x00garbage" * 100 if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        ModelRunner(ckpt, dtype="float32", device="cpu", num_blocks=2)


def test_missing_weights(ckpt):
    state = load_file(ckpt / "model.safetensors")
    del state["model.layers.1.self_attn.k_norm.weight"]
    save_file(state, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.layers.1.self_attn.k_norm.weight"):
        ModelRunner(ckpt, dtype="float32", device="cpu", num_blocks=2)
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        ModelRunner(ckpt, dtype="float32", device="cpu", num_blocks=2)


def test_wrong_shape(ckpt):
    edit_config(ckpt, intermediate_size=999)
    with pytest.raises(CheckpointError, match="gate_proj.weight.*shape"):
        ModelRunner(ckpt, dtype="float32", device="cpu", num_blocks=2)


def test_missing_shard(tmp_path, cases):
    sharded = save_checkpoint(cases["llama_tied"].hf, tmp_path / "sharded", max_shard_size="40KB")
    victim = sorted(sharded.glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        load_weights(sharded)


def test_engine_errors_are_typed():
    assert issubclass(CheckpointError, EngineError) and issubclass(EngineError, Exception)
