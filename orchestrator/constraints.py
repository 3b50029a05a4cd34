"""A turn's :class:`~agentserve.protocol.client_messages.Constraint` → the grammar its sampling carries.

Compiled and checked here, before the turn is scheduled: a schema or tool choice that cannot become a
grammar is the client's ``invalid_request``, and nothing runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from agentserve.orchestrator.text.grammar import (
    GrammarError,
    check,
    json_schema_grammar,
    ll_tokenizer,
    schema_or_calls_grammar,
    tool_call_grammar,
    tool_function,
)
from agentserve.orchestrator.text.tokenization import Tokenizer
from agentserve.protocol.client_messages import ErrorCode, ProtocolError, Turn
from agentserve.protocol.sampling import MAX_GRAMMAR_BYTES, SamplingParams

UNCONSTRAINED_CHOICES = ("", "auto", "none")
T = TypeVar("T")


def grammar_for(turn: Turn, tools: list[dict[str, Any]], tokenizer: Tokenizer, vocab_size: int) -> str:
    """The grammar text for ``turn`` ("" when it asks for none); raises :class:`GrammarError`.

    A forced call (``required`` or a name) takes the tool-call grammar whether or not a JSON schema is given: the
    schema shapes a reply's text, and a forced call has none (as vLLM and OpenAI answer it; the schema must still
    compile).  A schema with ``tool_choice`` ``auto`` and tools: the schema's JSON or calls of any tool; else the
    schema's JSON alone.  Calls name only ``allowed_tools`` where the constraint lists them."""
    c = turn.constraint
    forced = c is not None and c.tool_choice not in UNCONSTRAINED_CHOICES
    if c is None or (not c.json_schema and not forced):
        return ""
    if turn.token_ids:
        raise GrammarError("constrained output needs a chat turn (messages), not raw token ids", "")
    tagged = tokenizer.token_to_id("<tool_call>") is not None and tokenizer.token_to_id("</tool_call>") is not None
    fmt, callees = tokenizer.tool_call_format, _blamed("tools", lambda: _allowed(tools, c.allowed_tools))
    answer = ""
    if c.json_schema:  # checked on its own: a union with calls would hide a schema that allows nothing
        answer = _blamed("response_format", lambda: _checked(json_schema_grammar(c.json_schema), tokenizer, vocab_size))
    parallel = c.parallel_tool_calls
    if forced:
        grammar = _blamed("tools", lambda: tool_call_grammar(fmt, callees, c.tool_choice, parallel, tagged))
    elif c.tool_choice == "auto" and callees:
        grammar = _blamed("tools", lambda: schema_or_calls_grammar(c.json_schema, fmt, callees, parallel, tagged))
    else:
        return answer
    return _blamed("tools", lambda: _checked(grammar, tokenizer, vocab_size))


def _allowed(tools: list[dict[str, Any]], names: tuple[str, ...]) -> list[dict[str, Any]]:
    """The session's tools a call may name: those in ``names`` (all when it is empty)."""
    if not names:
        return tools
    known = [tool_function(t)["name"] for t in tools]
    for name in names:
        if name not in known:
            raise GrammarError(f"allowed tool `{name}` is not among the session's tools {known}", "tool_choice")
    return [t for t, n in zip(tools, known, strict=True) if n in names]


def _blamed(param: str, work: Callable[[], T]) -> T:
    """``work()``, its :class:`GrammarError` blaming ``param`` where it names no field itself."""
    try:
        return work()
    except GrammarError as e:
        if e.param is None:
            e.param = param
        raise


def _checked(grammar: str, tokenizer: Tokenizer, vocab_size: int) -> str:
    """``grammar`` once it fits a step and llguidance accepts it for this checkpoint's tokenizer."""
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
        # grammar_for names the field at fault on every error it raises (_blamed fills in the constraint's own)
        raise ProtocolError(ErrorCode.INVALID_REQUEST, str(e), turn.req, turn.session, e.param or "") from None
    return msgspec.structs.replace(params, grammar=grammar) if grammar else params

