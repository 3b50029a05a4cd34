"""Grammar masks where tokens are sampled: a constrained sequence on the real executor (tiny model, random
weights) writes JSON that validates, through decode plans sent ahead and after a recompute."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from agentserve.executor.builtin import resolve_model
from agentserve.executor.grammar import GrammarMasks, mask_logits
from agentserve.executor.runner import ModelRunner
from agentserve.executor.sequences import SequenceTable
from agentserve.executor.step import StepExecutor
from agentserve.orchestrator.text.grammar import GrammarError, json_schema_grammar, tool_call_grammar
from agentserve.orchestrator.text.tokenization import Tokenizer
from agentserve.orchestrator.text.tool_formats import HermesFormat
from agentserve.protocol.lanes import Lane
from agentserve.protocol.ring_messages import Plan, SeqPlan
from agentserve.protocol.sampling import Finish, SamplingParams

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["city", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine():
    model = resolve_model("tiny")
    runner = ModelRunner(model, dtype="float32", device="cpu", num_blocks=96)
    grammars = GrammarMasks(runner.model_dir / "tokenizer.json", runner.config.vocab_size,
                            runner.config.eos_token_ids)
    tok = Tokenizer.from_dir(model)

    def run(params: SamplingParams, prompt: list[int], seq_id: int) -> list[int]:
        ex = StepExecutor(runner, SequenceTable(runner.device, grammars), tok.eos_token_ids)
        blocks = list(range(seq_id * 16, seq_id * 16 + 16))  # 256 tokens per sequence
        (res,) = ex.run(Plan(0, Lane.DECODE, 0, 0, [SeqPlan(seq_id, prompt, 0, new_blocks=blocks, sampling=params)]))
        out = [res.token_id]
        while res.finish == Finish.NONE:  # decode plans without tokens: the executor feeds what it sampled
            (res,) = ex.run(Plan(len(out), Lane.DECODE, 0, 0, [SeqPlan(seq_id, [], len(prompt) + len(out) - 1)]))
            out.append(res.token_id)
        return out

    return tok, run


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 3}])
def test_constrained_output_validates(engine, sampling) -> None:
    tok, run = engine
    params = SamplingParams(max_tokens=120, grammar=json_schema_grammar(json.dumps(SCHEMA)), **sampling)
    out = run(params, tok.encode("Answer in JSON:"), 1)
    text = tok.decode([t for t in out if t not in tok.eos_token_ids])
    jsonschema.validate(json.loads(text), SCHEMA)
    unconstrained = run(SamplingParams(max_tokens=len(out), **sampling), tok.encode("Answer in JSON:"), 2)
    assert unconstrained != out, "the mask changed what was sampled"


def test_a_recomputed_sequence_resumes_its_grammar(engine) -> None:
    tok, run = engine
    grammar = json_schema_grammar(json.dumps(SCHEMA))
    prompt = tok.encode("Answer in JSON:")
    full = run(SamplingParams(max_tokens=120, grammar=grammar), prompt, 3)
    k = 4  # preempted after 4 tokens: recomputed with them in its prompt, the grammar told it saw them
    rest = run(SamplingParams(max_tokens=120 - k, grammar=grammar, grammar_prefix=full[:k]), prompt + full[:k], 4)
    assert full[:k] + rest == full


def test_mask_logits_leaves_unconstrained_rows_alone() -> None:
    model = resolve_model("tiny")
    grammars = GrammarMasks(f"{model}/tokenizer.json", 320, [258])
    m = grammars.matcher(json_schema_grammar('{"type": "integer"}'))
    logits = torch.randn(2, 320)
    before = logits.clone()
    mask_logits(logits, [None, m])
    assert torch.equal(logits[0], before[0])
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    tok = Tokenizer.from_dir(model)
    assert allowed and all(tok.decode([t]).strip("-0123456789") == "" for t in allowed)


@pytest.mark.parametrize("tools", [[{"function": "x"}], [{"type": "function", "function": {"description": "d"}}],
                                   [{"name": "f", "parameters": [1]}], ["f"]])
def test_badly_shaped_tools_are_a_grammar_error(tools) -> None:
    """Once AttributeError / KeyError: the client got `internal` instead of `invalid_request`."""
    with pytest.raises(GrammarError):
        tool_call_grammar(HermesFormat(), tools, "required", True)


def test_a_schema_nested_past_the_recursion_limit_is_a_grammar_error() -> None:
    with pytest.raises(GrammarError, match="nested too deeply"):
        json_schema_grammar("[" * 60_000)


class _Panic(BaseException):
    """What pyo3 raises for a Rust panic (``pyo3_runtime.PanicException`` derives from ``BaseException``)."""


@pytest.mark.parametrize("where", ["grammar_from_json_schema", "grammar_from_lark", "validate_grammar_with_warnings"])
def test_a_panic_inside_llguidance_is_the_clients_error_not_the_orchestrators_end(monkeypatch, where):
    """A fuzzed schema once made llguidance panic (it cut an error message inside a multi-byte character); uncaught,
    the panic ended the orchestrator.  Every call into llguidance turns one into :class:`GrammarError`, and lets
    an interrupt through."""
    import llguidance

    from agentserve.orchestrator.text.grammar import check, ll_tokenizer

    def panics(*args, **kwargs):
        raise _Panic("end byte index 100 is not a char boundary")

    monkeypatch.setattr(llguidance.LLMatcher, where, panics)
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "string"}}})
    tokenizer = ll_tokenizer(str(resolve_model("tiny") / "tokenizer.json"), None, ())
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(GrammarError, match="llguidance failed"):
        if where == "grammar_from_lark":
            tool_call_grammar(HermesFormat(), tools, "required", False)
        else:
            check(json_schema_grammar(schema), tokenizer)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(llguidance.LLMatcher, where, interrupted)
    with pytest.raises(KeyboardInterrupt):
        if where == "grammar_from_lark":
            tool_call_grammar(HermesFormat(), tools, "required", False)
        else:
            check(json_schema_grammar(schema), tokenizer)
