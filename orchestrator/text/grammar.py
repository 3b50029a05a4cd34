"""Grammars for constrained decoding (llguidance): JSON schemas, forced tool calls, and either of the two.

The orchestrator builds and checks a grammar when a turn asks for one (an invalid or unsupported
schema is the client's error, answered before anything runs); the executor builds a matcher from
the same grammar text and masks the logits where each token is sampled.  Grammars are llguidance's
own serialised form (``LLMatcher.grammar_from_*``); nothing here imports torch.

JSON is generated compactly (no free whitespace): a model with random weights would otherwise spend
its tokens on blanks.  A forced tool call is written in the checkpoint's tool-call format, its JSON
constrained to ``{"name": <one of the tools>, "arguments": <that tool's parameters schema>}``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

import llguidance

from agentserve.orchestrator.text.tool_formats import ToolCallFormat

JSON_OPTIONS = {"whitespace_flexible": False}
MAX_SCHEMA_BYTES = 64 * 1024


class GrammarError(ValueError):
    """A schema or tool choice that cannot be turned into a grammar (the client's error).  ``param``: the OpenAI
    request field at fault when it is not the constraint's own (``response_format`` for a JSON schema, ``tools`` for
    forced tool calls): ``tool_choice``, or "" when the fault is not one field; None: the constraint's own."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


T = TypeVar("T")


def _llguidance(call: Callable[[], T], what: str) -> T:
    """``call()`` into llguidance, its refusals and its panics as :class:`GrammarError` (``what`` failed).  A Rust panic
    arrives as pyo3's ``PanicException``, a ``BaseException``: uncaught it ended the orchestrator (seen on a fuzzed
    schema whose error message llguidance cut inside a multi-byte character)."""
    try:
        return call()
    except (ValueError, TypeError, RuntimeError) as e:  # RecursionError is a RuntimeError
        raise GrammarError(f"{what}: {e}") from None
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # noqa: BLE001 - pyo3's PanicException
        raise GrammarError(f"{what}: llguidance failed ({type(e).__name__}: {e})") from None


@lru_cache(maxsize=4)
def ll_tokenizer(tokenizer_json: str, vocab_size: int | None, eos_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """llguidance's view of a checkpoint's ``tokenizer.json`` (built once per process and model)."""
    text = Path(tokenizer_json).read_text(encoding="utf-8")
    return llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=list(eos_ids) or None)


def _schema_grammar(schema: dict[str, Any]) -> str:
    return _llguidance(lambda: llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS),
                       "the JSON schema cannot be compiled")


def json_schema_grammar(schema_text: str) -> str:
    return _schema_grammar(_schema_object(schema_text))


def _schema_object(schema_text: str) -> dict[str, Any]:
    """A request's JSON schema text as a schema object; :class:`GrammarError` if it is too large or none."""
    if len(schema_text.encode()) > MAX_SCHEMA_BYTES:
        raise GrammarError(f"the JSON schema is larger than {MAX_SCHEMA_BYTES} bytes")
    try:
        schema = json.loads(schema_text)
    except json.JSONDecodeError as e:
        raise GrammarError(f"the JSON schema is not JSON: {e}") from None
    except RecursionError:
        raise GrammarError("the JSON schema is nested too deeply") from None
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object")
    return schema


def tool_function(tool: Any) -> dict[str, Any]:
    """A session tool's function (OpenAI's ``{"type": "function", "function": {...}}`` or the function itself), with
    a string ``name`` and an object (or no) ``parameters``; ``GrammarError`` for any other shape."""
    fn = tool.get("function", tool) if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise GrammarError(f"a tool must be a function with a name to force calls to it: {str(tool)[:80]}")
    if not isinstance(fn.get("parameters") or {}, dict):
        raise GrammarError(f"the parameters of tool {fn['name']!r} must be a JSON schema object")
    return fn


def call_schema(tool: dict[str, Any], arguments_key: str, defs: dict[str, Any], prefix: str) -> dict[str, Any]:
    """One call's schema; parameters that use ``$ref`` go into ``defs`` under ``prefix`` (:func:`_hoisted`)."""
    fn = tool_function(tool)
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    if "$ref" in json.dumps(params):
        params = _hoisted(params, prefix, defs)
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, arguments_key: params},
            "required": ["name", arguments_key], "additionalProperties": False}


def _hoisted(params: dict[str, Any], prefix: str, defs: dict[str, Any]) -> dict[str, Any]:
    """A reference to ``params``, put into ``defs`` as ``prefix`` with its own ``$defs`` / ``definitions`` as
    ``prefix.NAME``, every ``$ref`` into them or into itself renamed to match: inside a call's arguments its
    pointers resolve from the root of the whole grammar's schema, not from its own (``#/$defs/x`` did not exist)."""
    own = {**(params.get("definitions") or {}), **(params.get("$defs") or {})}

    def rename(node: Any) -> Any:
        if isinstance(node, list):
            return [rename(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: rename(v) for k, v in node.items()}
        if isinstance(node.get("$ref"), str) and node["$ref"].startswith("#"):
            out["$ref"] = _renamed_ref(node["$ref"], prefix)
        return out

    try:
        defs[prefix] = rename({k: v for k, v in params.items() if k not in ("$defs", "definitions")})
        for name, schema in own.items():
            defs[f"{prefix}.{name}"] = rename(schema)
    except RecursionError:
        raise GrammarError("a tool's parameters are nested too deeply", "tools") from None
    return {"$ref": f"#/$defs/{prefix}"}


def _renamed_ref(ref: str, prefix: str) -> str:
    for root in ("#/$defs/", "#/definitions/"):
        if ref.startswith(root):
            name, slash, rest = ref[len(root):].partition("/")
            name = name.replace("~1", "/").replace("~0", "~")  # a pointer's escapes: the key as written
            key = f"{prefix}.{name}".replace("~", "~0").replace("/", "~1")
            return f"#/$defs/{key}{slash}{rest}"
    return f"#/$defs/{prefix}{ref[1:]}"  # "#" itself, or a pointer into the parameters' own body


def tool_call_grammar(fmt: ToolCallFormat, tools: list[dict[str, Any]], choice: str, parallel: bool,
                      tags_are_tokens: bool = True) -> str:
    """``choice``: ``required`` (any of ``tools``) or the name of one tool.  ``tags_are_tokens``: the
    tokenizer has ``<tool_call>`` / ``</tool_call>`` as tokens of their own (the model writes those)."""
    return _lark_grammar("start: calls\n" + _calls_rules(fmt, tools, choice, parallel, tags_are_tokens))


def schema_or_calls_grammar(schema_text: str, fmt: ToolCallFormat, tools: list[dict[str, Any]], parallel: bool,
                            tags_are_tokens: bool = True) -> str:
    """A reply that is either JSON of ``schema_text`` or calls of any of ``tools``: ``response_format`` beside tools
    the model may call (``tool_choice`` auto), as OpenAI answers it — an agent with an output type and tools calls
    its tools, then answers in its type."""
    answer = json.dumps({**_schema_object(schema_text), "x-guidance": JSON_OPTIONS})
    rules = _calls_rules(fmt, tools, "required", parallel, tags_are_tokens)
    return _lark_grammar(f"start: answer | calls\nanswer: %json {answer}\n{rules}")


def _calls_rules(fmt: ToolCallFormat, tools: list[dict[str, Any]], choice: str, parallel: bool,
                 tags_are_tokens: bool) -> str:
    """Lark rules ``calls`` (one call, or one or more with ``parallel``) in the checkpoint's tool-call format, and
    ``body``: a call's JSON, ``{"name": <one of the chosen tools>, "arguments": <its parameters' schema>}``."""
    names = [tool_function(t)["name"] for t in tools]
    if choice != "required" and choice not in names:
        raise GrammarError(f"tool_choice names `{choice}`, which is not among the session's tools {names}",
                           "tool_choice")
    if not tools:
        raise GrammarError("tool_choice needs tools", "tool_choice")
    key = "parameters" if fmt.name == "llama3_json" else "arguments"
    chosen = [t for t, n in zip(tools, names, strict=True) if choice == "required" or n == choice]
    defs: dict[str, Any] = {}
    schemas = [call_schema(t, key, defs, f"tool{i}") for i, t in enumerate(chosen)]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    body = json.dumps({**schema, **({"$defs": defs} if defs else {}), "x-guidance": JSON_OPTIONS})
    if fmt.name == "llama3_json":
        call, sep = "body", '"; "'
    else:
        opened, closed = ("<tool_call>", "</tool_call>") if tags_are_tokens else ('"<tool_call>"', '"</tool_call>"')
        call, sep = f'{opened} "\\n" body "\\n" {closed}', '"\\n"'
    repeat = f"({sep} {call})*" if parallel else ""
    return f"calls: {call} {repeat}\nbody: %json {body}\n"


def _lark_grammar(lark: str) -> str:
    return _llguidance(lambda: llguidance.LLMatcher.grammar_from_lark(lark), "the tools' schemas cannot be compiled")


def check(grammar: str, tokenizer: llguidance.LLTokenizer) -> None:
    """Raise :class:`GrammarError` if llguidance refuses ``grammar`` for this tokenizer."""
    is_error, messages = _llguidance(lambda: llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer),
                                     "the grammar cannot be checked")
    if is_error:
        raise GrammarError(f"the grammar is invalid: {'; '.join(messages)}")
    what = "the grammar cannot be checked"
    matcher = _llguidance(lambda: llguidance.LLMatcher(tokenizer, grammar, log_level=0), what)
    _llguidance(matcher.compute_bitmask, what)  # an empty language fails only here (``{"$ref": "#"}``, a $ref cycle)
    if matcher.is_error():
        raise GrammarError("the constraint allows no output at all (e.g. a schema that only refers to itself)")
