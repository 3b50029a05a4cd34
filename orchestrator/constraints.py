"""A turn's :class:`~agentserve.protocol.client_messages.Constraint` → the grammar its sampling carries.

Compiled and checked here, before the turn is scheduled: a schema or tool choice that cannot become a
grammar is the client's ``invalid_request``, and nothing runs.
"""

from __future__ import annotations

from typing import Any

import msgspec

from agentserve.orchestrator.text.grammar import (
    GrammarError,
    check,
    json_schema_grammar,
    ll_tokenizer,
    schema_or_calls_grammar,
    tool_call_grammar,
)
from agentserve.orchestrator.text.tokenization import Tokenizer
from agentserve.protocol.client_messages import Constraint, ErrorCode, ProtocolError, Turn
from agentserve.protocol.sampling import MAX_GRAMMAR_BYTES, SamplingParams

UNCONSTRAINED_CHOICES = ("", "auto", "none")


def grammar_for(turn: Turn, tools: list[dict[str, Any]], tokenizer: Tokenizer, vocab_size: int) -> str:
    """The grammar text for ``turn`` ("" when it asks for none); raises :class:`GrammarError`.

    A forced call (``required`` or a name) takes the tool-call grammar whether or not a JSON schema is given: the
    schema shapes a reply's text, and a forced call has none (as vLLM and OpenAI answer it).  A schema with
    ``tool_choice`` ``auto`` and tools: the schema's JSON or calls of any tool; else the schema's JSON alone."""
    c = turn.constraint
    forced = _forced(c)
    if c is None or (not c.json_schema and not forced):
        return ""
    if turn.token_ids:
        raise GrammarError("constrained output needs a chat turn (messages), not raw token ids", "")
    tagged = tokenizer.token_to_id("<tool_call>") is not None and tokenizer.token_to_id("</tool_call>") is not None
    fmt = tokenizer.tool_call_format
    if forced:
        grammar = tool_call_grammar(fmt, tools, c.tool_choice, c.parallel_tool_calls, tagged)
    elif c.tool_choice == "auto" and tools:
        grammar = schema_or_calls_grammar(c.json_schema, fmt, tools, c.parallel_tool_calls, tagged)
    else:
        grammar = json_schema_grammar(c.json_schema)
    size = len(grammar.encode())
    if size > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"the constraint's grammar is {size} bytes, more than the {MAX_GRAMMAR_BYTES} one step "
                           "carries: fewer or smaller tool schemas, or a smaller JSON schema")
    if tokenizer.folder is not None:
        eos = tuple(tokenizer.eos_token_ids)
        check(grammar, ll_tokenizer(str(tokenizer.folder / "tokenizer.json"), vocab_size or None, eos))
    return grammar


def constrained_sampling(turn: Turn, tools: list[dict[str, Any]], tokenizer: Tokenizer, vocab_size: int
                         ) -> SamplingParams:
    """``turn``'s sampling parameters with its grammar; ``ProtocolError(invalid_request)`` if it has none."""
    params = turn.sampling_params()
    try:
        grammar = grammar_for(turn, tools, tokenizer, vocab_size)
    except GrammarError as e:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, str(e), turn.req, turn.session, _param(turn, e)) from None
    return msgspec.structs.replace(params, grammar=grammar) if grammar else params


def _param(turn: Turn, error: GrammarError) -> str:
    """The OpenAI request field a grammar error blames: its own, else the constraint's (a JSON schema is the
    request's ``response_format``, forced tool calls compile the session's ``tools``)."""
    if error.param is not None:
        return error.param
    c = turn.constraint
    return "response_format" if c is not None and c.json_schema and not _forced(c) else "tools"


def _forced(c: Constraint | None) -> bool:
    """Whether ``c`` forces a call (``required`` or a tool's name): the tool-call grammar, whatever its schema."""
    return c is not None and c.tool_choice not in UNCONSTRAINED_CHOICES
