"""``agentserve generate``: offline generation in-process — the smoke test after downloading a model.

Bad input (unknown model or architecture, missing or corrupt files, a prompt longer than the
context, invalid sampling values, a bad JSONL line) ends with one ``error:`` line on stderr and exit
code 2, never a traceback.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from agentserve import configs
from agentserve.cli.engine_options import engine_config, engine_flags
from agentserve.cli.prompts import Prompt, check_unicode, load_prompts_file, parse_ids
from agentserve.configs.logging import LOG_LEVELS, setup_logging

EXIT_BAD_INPUT = 2


def _encode(prompt: Prompt, tokenizer: Any, chat: bool) -> list[int]:
    if prompt.ids is not None:
        return prompt.ids
    if prompt.messages is not None:
        return tokenizer.encode_chat(prompt.messages, tools=prompt.tools)
    if chat:
        return tokenizer.encode_chat([{"role": "user", "content": prompt.text}])
    return tokenizer.encode(prompt.text)


def _kv_blocks(prompts: list[list[int]], max_tokens: int, context: int, block_size: int, batch: int) -> int:
    """Enough KV blocks for the largest ``batch`` sequences of this job (no bigger: it is preallocated)."""
    needs = sorted((-(-min(len(p) + max_tokens, context) // block_size) for p in prompts), reverse=True)
    return sum(needs[:batch])


def _runner_kwargs(engine: dict[str, Any], path: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from agentserve.executor.checkpoint import load_config

    context = load_config(path).max_position_embeddings
    if engine["max_model_len"]:
        context = min(context, int(engine["max_model_len"]))
    kwargs: dict[str, Any] = {
        "dtype": engine["dtype"],
        "weights": engine["weights"],
        "kv_cache_dtype": engine["kv_cache_dtype"],
        "device": engine["device"],
        "block_size": int(engine["block_size"]),
        "attention_backend": engine["attention_backend"],
        "decode_step": engine["decode_step"],
        "prefill_attention": engine["prefill_attention"],
        "max_model_len": context,
    }
    if kwargs["block_size"] < 1:  # sizes the KV cache below: refused here, not divided by
        raise ValueError(f"[engine] block_size must be >= 1, got {kwargs['block_size']}")
    if float(engine["kv_cache_memory_gb"]) > 0:
        kwargs["kv_cache_bytes"] = int(float(engine["kv_cache_memory_gb"]) * 2**30)
    else:
        kwargs["num_blocks"] = _kv_blocks(prompts, max_tokens, context, kwargs["block_size"],
                                          int(engine["max_batch_size"]))
    return kwargs


def _print(outputs: list[Any], prompts: list[list[int]], as_json: bool) -> None:
    for i, (out, prompt) in enumerate(zip(outputs, prompts, strict=True)):
        if as_json:
            click.echo(json.dumps({
                "index": i, "prompt_tokens": len(prompt), "token_ids": out.token_ids, "text": out.text,
                "finish_reason": out.finish_reason, "logprobs": out.logprobs,
            }, ensure_ascii=False))
        else:
            if len(outputs) > 1:
                click.echo(f"--- prompt {i} ({len(out.token_ids)} tokens, {out.finish_reason}) ---")
            click.echo(out.text)


def run_generate(opts: dict[str, Any]) -> None:
    """Everything after argument parsing; raises typed errors for bad input."""
    from agentserve.executor.builtin import resolve_model
    from agentserve.executor.checkpoint import load_config
    from agentserve.orchestrator.text.tokenization import Tokenizer
    from agentserve.protocol.sampling import SamplingParams

    given = {k: opts[k] for k in ("model", "dtype", "weights", "device")} | {"prefill_chunk_size": opts["chunk_size"]}
    engine = engine_config(opts["config_file"], given)
    path = resolve_model(str(engine["model"]), str(engine["cache_dir"]) or None)
    load_config(path)  # unknown architecture / bad config.json: fail before loading weights
    needs_text = any(p.ids is None for p in opts["prompts"]) or (path / "tokenizer.json").exists()
    tokenizer = Tokenizer.from_dir(path) if needs_text else None  # token ids only: the tokenizer is optional
    prompts = [_encode(p, tokenizer, opts["chat"]) for p in opts["prompts"]]
    params = SamplingParams(temperature=opts["temperature"], top_k=opts["top_k"], top_p=opts["top_p"],
                            min_p=opts["min_p"], seed=opts["seed"], max_tokens=opts["max_tokens"],
                            ignore_eos=opts["ignore_eos"])
    params.validate()  # ValueError naming the field, before any weights are read

    from agentserve.cli.offline import LLM

    llm = LLM(path, max_batch_size=int(engine["max_batch_size"]),
              **_runner_kwargs(engine, path, prompts, opts["max_tokens"]))
    stop = [list(opts["stop"]) for _ in prompts]
    outputs = llm.generate(prompts, params, stop, chunk_size=int(engine["prefill_chunk_size"]))
    _print(outputs, prompts, opts["as_json"])


def _collect_prompts(text: tuple[str, ...], ids: str | None, file: str | None) -> list[Prompt]:
    if sum(bool(x) for x in (text, ids, file)) != 1:
        raise click.UsageError("give exactly one of --prompt, --prompt-ids, --prompts-file")
    if ids:
        return [Prompt(ids=parse_ids(ids))]
    if file:
        return load_prompts_file(file)
    for t in text:
        check_unicode(t, "--prompt")
    return [Prompt(text=t) for t in text]


@click.command("generate")
@click.option("--model", default=None, help="Checkpoint folder, or a built-in model: tiny | bench. [default: tiny]")
@click.option("--prompt", "prompt_text", multiple=True, help="Prompt text (repeat for a batch).")
@click.option("--prompt-ids", default=None, help="Prompt token ids, comma separated: 1,2,3")
@click.option("--prompts-file", type=click.Path(dir_okay=False), default=None,
              help='JSONL; per line {"prompt": str} | {"prompt_ids": [int]} | {"messages": [...], "tools": [...]}')
@click.option("--max-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True, help="0 = off")
@click.option("--min-p", type=float, default=0.0, show_default=True)
@click.option("--seed", type=int, default=None, help="Per-request seed (reproducible sampling).")
@click.option("--stop", multiple=True, help="Stop string (repeatable); not included in the output.")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past eos (benchmarks).")
@click.option("--chunk-size", type=int, default=None, help="Prefill chunk tokens [default: engine.toml]")
@click.option("--chat", is_flag=True, help="Wrap text prompts as a user message in the chat template.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per prompt.")
@engine_flags
@click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None, help="A TOML file.")
@click.option("--log-level", type=click.Choice(LOG_LEVELS, case_sensitive=False), default="WARNING",
              show_default=True)
def generate(prompt_text: tuple[str, ...], prompt_ids: str | None, prompts_file: str | None, **opts: Any) -> None:
    """Generate text for one prompt or a batch, in this process."""
    from agentserve.executor.errors import EngineError

    setup_logging(opts.pop("log_level"))
    try:
        if opts["chat"] and prompt_ids:  # token ids go in as they are: --chat would be dropped without a word
            raise ValueError("--chat wraps text prompts in the chat template; --prompt-ids are taken as they are")
        opts["prompts"] = _collect_prompts(prompt_text, prompt_ids, prompts_file)
        run_generate(opts)
    except (EngineError, configs.ConfigError, ValueError, OSError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(EXIT_BAD_INPUT)
