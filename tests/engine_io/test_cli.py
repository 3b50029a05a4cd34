"""``agentserve generate`` through click's CliRunner, one real subprocess, and every bad-input case."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from agentserve.cli.main import main
from agentserve.protocol.sampling import SamplingParams


@pytest.fixture(autouse=True)
def _env(cache_dir, tiny_dir, monkeypatch):
    monkeypatch.setenv("AGENTSERVE_CACHE_DIR", str(cache_dir))
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def run(*args: str):
    return CliRunner().invoke(main, ["generate", "--model", "tiny", "--dtype", "float32", *args])


def lines(result) -> list[dict]:
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_json_matches_offline_llm(tiny_llm):
    (out,) = lines(run("--prompt", "hi", "--max-tokens", "8", "--json", "--ignore-eos"))
    ids = tiny_llm.tokenizer.encode("hi")
    want = tiny_llm.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert out["token_ids"] == want.token_ids and out["text"] == want.text
    assert out["finish_reason"] == "length" and out["prompt_tokens"] == len(ids)


def test_prompts_file_batch_and_chat(tmp_path, tiny_llm):
    messages = [{"role": "user", "content": "weather?"}]
    tools = [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}]
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join([json.dumps({"prompt": "abc"}), "", json.dumps({"prompt_ids": [1, 2, 3]}),
                            json.dumps({"messages": messages, "tools": tools})]) + "\n")
    outs = lines(run("--prompts-file", str(f), "--max-tokens", "4", "--json", "--chunk-size", "5"))
    tok = tiny_llm.tokenizer
    assert [o["prompt_tokens"] for o in outs] == [3, 3, len(tok.encode_chat(messages, tools=tools))]
    assert [o["index"] for o in outs] == [0, 1, 2]
    (chat,) = lines(run("--prompt", "weather?", "--chat", "--max-tokens", "2", "--json"))
    assert chat["prompt_tokens"] == len(tok.encode_chat(messages))


def test_plain_output_and_stop_string():
    full = run("--prompt-ids", "1,2,3", "--max-tokens", "12", "--temperature", "1", "--seed", "5", "--ignore-eos",
               "--json")
    text = lines(full)[0]["text"]
    stop = next(text[i:i + 2] for i in range(2, len(text) - 1) if text[i:i + 2].isascii())
    (cut,) = lines(run("--prompt-ids", "1,2,3", "--max-tokens", "12", "--temperature", "1", "--seed", "5",
                       "--ignore-eos", "--stop", stop, "--json"))
    assert cut["text"] == text[: text.find(stop)] and cut["finish_reason"] == "stop"
    plain = run("--prompt", "a", "--prompt", "b", "--max-tokens", "3")
    assert plain.exit_code == 0 and plain.stdout.count("--- prompt") == 2


def test_subprocess_console_script(cache_dir):
    exe = shutil.which("agentserve", path=str(Path(sys.executable).parent))
    assert exe is not None
    env = {"AGENTSERVE_CACHE_DIR": str(cache_dir), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
           "AGENTSERVE_KERNEL_DIR": os.environ["AGENTSERVE_KERNEL_DIR"]}  # the session's kernel build folder
    proc = subprocess.run([exe, "generate", "--model", "tiny", "--prompt", "hi", "--max-tokens", "8", "--json"],
                          capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) >= {"token_ids", "text", "finish_reason"}
    assert 1 <= len(out["token_ids"]) <= 8 and isinstance(out["text"], str)
    assert out["finish_reason"] in ("stop", "length")


def _bad_checkpoints(root: Path, tiny: Path) -> dict[str, tuple[Path, str]]:
    def copy(name: str) -> Path:
        return Path(shutil.copytree(tiny, root / name))

    arch = copy("arch")
    cfg = json.loads((arch / "config.json").read_text())
    (arch / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    corrupt_cfg = copy("corrupt_cfg")
    (corrupt_cfg / "config.json").write_text("{oops")
    no_tok = copy("no_tok")
    (no_tok / "tokenizer.json").unlink()
    bad_weights = copy("bad_weights")
    data = (bad_weights / "model.safetensors").read_bytes()
    (bad_weights / "model.safetensors").write_bytes(data[: len(data) // 2])
    no_weights = copy("no_weights")
    (no_weights / "model.safetensors").unlink()
    empty = root / "empty"
    empty.mkdir()
    return {
        "arch": (arch, "unsupported architecture GPT2LMHeadModel"),
        "corrupt_cfg": (corrupt_cfg, "corrupt"),
        "no_tok": (no_tok, "missing tokenizer.json"),
        "bad_weights": (bad_weights, "model.safetensors"),
        "no_weights": (no_weights, "no *.safetensors"),
        "empty": (empty, "no config.json"),
    }


def assert_bad(result, message: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.output
    said = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(said) == 1 or (len(said) == 3 and said[0].startswith("Usage:"))  # click usage errors add a hint


@pytest.mark.parametrize("case", ["arch", "corrupt_cfg", "no_tok", "bad_weights", "no_weights", "empty"])
def test_bad_checkpoint_folders(tmp_path, tiny_dir, case):
    folder, message = _bad_checkpoints(tmp_path, tiny_dir)[case]
    result = CliRunner().invoke(main, ["generate", "--model", str(folder), "--prompt", "hi", "--max-tokens", "2"])
    assert_bad(result, message)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "nope", "--prompt", "x"], "unknown model 'nope'"),
        (["--prompt-ids", ",".join(["1"] * 4100)], "4100 tokens"),
        (["--prompt-ids", "1,99999"], "outside the vocabulary"),
        (["--prompt", "x", "--max-tokens", "0"], "max_tokens must be > 0"),
        (["--prompt", "x", "--max-tokens", "-3"], "max_tokens must be > 0"),
        (["--prompt", "x", "--temperature", "-1"], "temperature must be >= 0"),
        (["--prompt", "x", "--temperature", "nan"], "temperature must be >= 0"),
        (["--prompt", "x", "--top-p", "0"], "top_p must be in (0, 1]"),
        (["--prompt", "x", "--top-p", "1.5"], "top_p must be in (0, 1]"),
        (["--prompt", "x", "--top-k", "-1"], "top_k must be >= 0"),
        (["--prompt", "x", "--min-p", "2"], "min_p must be in [0, 1]"),
        (["--prompt", "x", "--seed", "-1"], "seed must be in"),
        (["--prompt", "x", "--chunk-size", "0"], "chunk size must be > 0"),
        (["--prompt", "x", "--dtype", "int8"], "unknown dtype 'int8'"),
        (["--prompt", "x", "--weights", "int4"], "unknown weights setting 'int4'"),
        (["--prompt", "x", "--weights", "fp16", "--dtype", "bfloat16"], "needs device cpu and dtype float32"),
        (["--prompt-ids", "1,a"], "comma-separated integers"),
        (["--prompt", "x", "--prompt-ids", "1"], "exactly one of --prompt"),
        ([], "exactly one of --prompt"),
        (["--prompt", "x", "--max-tokens", "ten"], "'ten' is not a valid integer"),
        (["--prompts-file", "/nonexistent.jsonl"], "prompts file not found"),
        (["--prompt", "x", "--config", "/nonexistent.toml"], "config file not found"),
        (["--prompt", "ab\udcffcd"], "--prompt: not valid Unicode text"),  # undecodable bytes, as Python reads them
        (["--prompt-ids", "1,2", "--chat"], "--prompt-ids are taken as they are"),
    ],
)
def test_bad_arguments(args, message):
    result = CliRunner().invoke(main, ["generate", *(["--model", "tiny"] if "--model" not in args else []), *args])
    assert_bad(result, message)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"prompt": "a"}\n{broken\n', "p.jsonl:2: not valid JSON"),
        ('[1, 2]\n', "p.jsonl:1: expected a JSON object"),
        ('{"text": "a"}\n', "needs exactly one of 'prompt', 'prompt_ids', 'messages'"),
        ('{"prompt": "a", "prompt_ids": [1]}\n', "needs exactly one of"),
        ('{"prompt_ids": [1, "2"]}\n', "'prompt_ids' must be a non-empty list of integers"),
        ('{"prompt_ids": []}\n', "'prompt_ids' must be a non-empty list of integers"),
        ('{"prompt": 5}\n', "'prompt' must be a string"),
        ('{"messages": [{"content": "x"}]}\n', "'messages' must be a non-empty list"),
        ('{"messages": [{"role": "user", "content": "x"}], "tools": "no"}\n', "'tools' must be a list"),
        ("\n\n", "has no prompts"),
        ('{"prompt": "\\ud800"}\n', "p.jsonl:1: not valid Unicode text"),  # a lone surrogate: a TypeError before
        ('{"messages": [{"role": "user", "content": "\\udc00"}]}\n', "p.jsonl:1: not valid Unicode text"),
    ],
)
def test_bad_jsonl(tmp_path, content, message):
    f = tmp_path / "p.jsonl"
    f.write_text(content)
    assert_bad(run("--prompts-file", str(f)), message)


def test_a_config_block_size_of_0_is_a_clean_error(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text("[engine]\nblock_size = 0\n")
    assert_bad(run("--prompt", "x", "--config", str(config)), "block_size must be >= 1, got 0")  # ZeroDivisionError


def test_bad_chat_conversation_is_a_clean_error(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": {"nested": 1}}]}) + "\n")
    assert_bad(run("--prompts-file", str(f)), "chat template failed")


def test_up_with_an_unknown_model_prints_one_line_and_exits_2(tmp_path):
    result = CliRunner().invoke(main, ["up", "--model", str(tmp_path / "nope"), "--run", "unknownmodel"])
    assert result.exit_code == 2
    assert "unknown model" in result.output and "Traceback" not in result.output
