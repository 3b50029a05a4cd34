"""A chat-completions request, checked and translated into what the orchestrator runs.

Everything checkable here is checked here (400 with the field named); what only the orchestrator
can judge (sampling ranges, the prompt's length, the schema's grammar) comes back as a typed error
that :mod:`agentserve.gateway.errors` maps to a 400 as well.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import msgspec

from agentserve.gateway.backend import Backend
from agentserve.gateway.conversations import chain
from agentserve.gateway.errors import bad_request
from agentserve.gateway.logprobs import chat_options
from agentserve.gateway.messages import Canonical, Translated, translate
from agentserve.gateway.schemas import ChatCompletionRequest, SamplingFields, Tool, ToolChoiceObject, check_unsupported
from agentserve.orchestrator.text.tool_formats import ToolCallFormat
from agentserve.protocol.client_messages import Constraint, Message


@dataclass
class ChatPlan:
    model: str
    translated: Translated
    tools: list[dict[str, Any]]
    tool_format: ToolCallFormat | None  # None: the reply is not scanned for tool calls
    options: dict[str, Any]  # Session.turn keyword options (sampling, stop, max_tokens)
    n: int
    stream: bool
    include_usage: bool
    seed_digest: bytes  # what else a continuation must match: the model and the tools
    max_calls: int | None = None  # 1 with parallel_tool_calls false: the calls past it are left out

    def digests(self, extra: list[Canonical] | None = None) -> list[bytes]:
        return chain(self.seed_digest, [*self.translated.canonical, *(extra or [])])

    def messages_after(self, k: int) -> list[Message]:
        """The messages after the first ``k`` (which a filed session already holds)."""
        return self.translated.messages[k - self.translated.leading:]

    @property
    def logprobs(self) -> bool:
        return bool(self.options.get("logprobs"))

    def choice_options(self, index: int) -> dict[str, Any]:
        """Choice ``index``'s options: with ``n > 1`` and a seed, each choice draws from seed + index, wrapped into the
        seeds' range [0, 2**63) (choice 0 keeps the seed as given, so one out of range is still refused)."""
        seed = self.options.get("seed")
        return self.options | ({"seed": (seed + index) % (MAX_INT64 + 1)} if seed is not None and index else {})


MAX_INT64 = 2**63 - 1


def sampling_options(req: SamplingFields, max_tokens: int | None, backend: Backend,
                     max_tokens_field: str = "max_tokens") -> dict[str, Any]:
    """The turn's sampling and stopping options (``max_tokens`` as the request named it: ``max_tokens_field``); the
    orchestrator checks them against its limits (the number of stop strings, their bytes)."""
    max_model_len, max_n = backend.require()[1].max_model_len, backend.options.max_n
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(not s for s in stops):
        raise bad_request("stop sequences must not be empty", param="stop")
    if max_tokens is not None and not 1 <= max_tokens <= MAX_INT64:  # past the context: clamped to it, below
        raise bad_request(f"{max_tokens_field} must be between 1 and {MAX_INT64}", param=max_tokens_field)
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream: true", param="stream_options")
    check_unsupported(req)
    if not 1 <= req.n <= max_n:
        raise bad_request(f"n must be between 1 and {max_n}", param="n")
    out: dict[str, Any] = {"max_tokens": min(max_tokens or max_model_len, max_model_len), "stop": stops,
                           "ignore_eos": req.ignore_eos,
                           "temperature": 1.0 if req.temperature is None else req.temperature}
    for key in ("top_p", "top_k", "min_p", "seed"):
        if getattr(req, key) is not None:
            out[key] = getattr(req, key)
    if req.top_k is not None and req.top_k < 0:  # OpenAI-style "-1: off"
        out["top_k"] = 0
    return out


# OpenAI's ^[a-zA-Z0-9_-]{1,64}$ widened to the names MCP tools carry (letters of any script, '.', ':', '/', up
# to 128): nothing in it can end a string or a tag of the prompt the chat template writes the name into
TOOL_NAME = re.compile(r"[\w.:/-]{1,128}")


def check_tool_name(name: str, param: str) -> None:
    """A 400 for a function name that could change what the model reads: the chat template writes it into the
    prompt as sent, so a quote, a ``</tool_call>`` or a line break in it would."""
    if not TOOL_NAME.fullmatch(name):
        shown = name if len(name) <= 80 else name[:80] + "..."
        raise bad_request(f"invalid function name {shown!r}: 1 to 128 letters, digits, '_', '-', '.', ':' or '/'",
                          param=param)


def tool_dicts(tools_in: list[Tool] | None) -> list[dict[str, Any]]:
    """A request's function tools as the chat template and the orchestrator take them (400 for a bad name)."""
    tools = []
    for i, t in enumerate(tools_in or []):
        check_tool_name(t.function.name, f"tools[{i}].function.name")
        fn: dict[str, Any] = {"name": t.function.name}
        if t.function.description is not None:
            fn["description"] = t.function.description
        fn["parameters"] = t.function.parameters or {"type": "object", "properties": {}}
        tools.append({"type": "function", "function": fn})
    return tools


def _check_tool_choice(req: ChatCompletionRequest, tools: list[dict[str, Any]]) -> None:
    choice = req.tool_choice
    if choice in (None, "none", "auto"):
        return
    if not tools:
        raise bad_request("tool_choice requires tools", param="tool_choice")
    if isinstance(choice, ToolChoiceObject):
        if choice.function is None:
            raise bad_request("a function tool_choice needs `function` with the function's name",
                              param="tool_choice.function")
        _require_known([choice.function.name], tools, "names", "tool_choice")


def _require_known(names: list[str] | tuple[str, ...], tools: list[dict[str, Any]], how: str, param: str) -> None:
    """A 400 on ``param`` for the first of ``names`` that no tool has ("tool_choice ``how`` `x`, which is not ...")."""
    known = [t["function"]["name"] for t in tools]
    for name in names:
        if name not in known:
            raise bad_request(f"tool_choice {how} `{name}`, which is not among the tools {known}", param=param)


def constraint(req: ChatCompletionRequest, allowed: tuple[str, ...] = ()) -> Constraint | None:
    """The grammar a request asks for: ``response_format`` json_object / json_schema (or calls of its tools, where the
    model may call them), or a forced tool call (``tool_choice`` required or named: the call, whatever the
    ``response_format``); ``allowed``: the tools a call may name (an ``allowed_tools`` choice; without a schema its
    ``auto`` mode compiles no grammar, so it is not enforced).  The orchestrator compiles it (a 400 if it cannot)."""
    fmt = req.response_format
    schema = ""
    if fmt is not None and fmt.type == "json_object":
        schema = '{"type": "object"}'
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise bad_request("response_format json_schema needs `json_schema`", param="response_format")
        given = fmt.json_schema.schema  # {} is any JSON value, as JSON Schema (and vLLM) read it; absent: an object
        schema = json.dumps({"type": "object"} if given is None else given, ensure_ascii=False)
    choice = req.tool_choice
    forced = choice.function.name if isinstance(choice, ToolChoiceObject) else choice if choice == "required" else ""
    if not schema and not forced:
        return None
    tool_choice = forced or ("auto" if req.tools and choice != "none" else "")  # auto: the schema's JSON, or calls
    # a named function is one call (as OpenAI and vLLM answer it); otherwise parallel unless told not to
    parallel = not isinstance(choice, ToolChoiceObject) and req.parallel_tool_calls is not False
    return Constraint(json_schema=schema, tool_choice=tool_choice, parallel_tool_calls=parallel, allowed_tools=allowed)


def allowed_tools_choice(req: ChatCompletionRequest,
                         tools: list[dict[str, Any]]) -> tuple[ChatCompletionRequest, tuple[str, ...]]:
    """An ``allowed_tools`` choice as its mode and the names a call may take (every tool stays in the prompt, as
    OpenAI keeps them); any other request as it is, with no names."""
    choice = req.tool_choice
    if not isinstance(choice, ToolChoiceObject) or choice.type != "allowed_tools":
        return req, ()
    if choice.allowed_tools is None or not choice.allowed_tools.tools:
        raise bad_request("an allowed_tools tool_choice needs `allowed_tools` naming at least one tool",
                          param="tool_choice.allowed_tools")
    allowed = tuple(dict.fromkeys(t.function.name for t in choice.allowed_tools.tools))
    _require_known(allowed, tools, "allows", "tool_choice.allowed_tools.tools")
    return msgspec.structs.replace(req, tool_choice=choice.allowed_tools.mode), allowed


def plan_chat(req: ChatCompletionRequest, backend: Backend) -> ChatPlan:
    _, welcome, tokenizer = backend.require()
    backend.check_model(req.model)
    translated = translate(req.messages)
    tools = tool_dicts(req.tools)
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tool names must be unique", param="tools")
    req, allowed = allowed_tools_choice(req, tools)
    _check_tool_choice(req, tools)
    named = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    options = sampling_options(req, getattr(req, named), backend, named)
    options["constraint"] = constraint(req, allowed)
    options |= chat_options(req.logprobs, req.top_logprobs)
    scan = bool(tools) and req.tool_choice != "none"
    seed = json.dumps([backend.model_name, tools], sort_keys=True).encode()
    return ChatPlan(
        model=backend.model_name, translated=translated, tools=tools,
        tool_format=tokenizer.tool_call_format if scan else None, options=options, n=req.n, stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage), seed_digest=seed,
        max_calls=1 if req.parallel_tool_calls is False else None,
    )
