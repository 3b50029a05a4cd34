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
    tool_call_grammar,
)
from agentserve.orchestrator.text.tokenization import Tokenizer
from agentserve.protocol.client_messages import ErrorCode, ProtocolError, Turn
from agentserve.protocol.sampling import MAX_GRAMMAR_BYTES, SamplingParams

UNCONSTRAINED_CHOICES = ("", "auto", "none")


def grammar_for(turn: Turn, tools: list[dict[str, Any]], tokenizer: Tokenizer, vocab_size: int) -> str:
    """The grammar text for ``turn`` ("" when it asks for none); raises :class:`GrammarError`."""
    c = turn.constraint
    if c is None or (not c.json_schema and c.tool_choice in UNCONSTRAINED_CHOICES):
        return ""
    if c.json_schema and c.tool_choice not in UNCONSTRAINED_CHOICES:
        raise GrammarError("a turn constrains to a JSON schema or to tool calls, not both", "")
    if turn.token_ids:
        raise GrammarError("constrained output needs a chat turn (messages), not raw token ids", "")
    if c.json_schema:
        grammar = json_schema_grammar(c.json_schema)
    else:
        tagged = tokenizer.token_to_id("<tool_call>") is not None and tokenizer.token_to_id("</tool_call>") is not None
        grammar = tool_call_grammar(tokenizer.tool_call_format, tools, c.tool_choice, c.parallel_tool_calls, tagged)
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
    return "response_format" if turn.constraint is not None and turn.constraint.json_schema else "tools"
