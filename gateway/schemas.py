"""The request bodies of the OpenAI API as msgspec structs: decoding is validation.

Unknown fields are accepted and ignored (``user``, ``metadata``, ``store``, ``prompt_cache_key``,
``reasoning_effort``, ...), as OpenAI-compatible servers do, except those that would change what is sampled:
they are declared here and a value other than their neutral one is a 400 (:func:`check_unsupported`).  An
explicit ``null`` means the default, as OpenAI reads it.  A body that does not decode into these types is a 400
naming the field (:func:`decode_body`).
"""

from __future__ import annotations

import functools
import json
from typing import Any, Literal, TypeVar

import msgspec

from agentserve.gateway.errors import bad_request


class _Body(msgspec.Struct, kw_only=True):
    def __post_init__(self) -> None:
        """An explicit ``null`` for a field declared nullable with another default is that default."""
        for name, default in _null_defaults(type(self)):
            if getattr(self, name) is None:
                setattr(self, name, default)


@functools.cache
def _null_defaults(cls: type[msgspec.Struct]) -> tuple[tuple[str, Any], ...]:
    """``cls``'s fields whose default is not None (only those declared ``X | None`` can decode as None)."""
    return tuple((f.name, f.default) for f in msgspec.structs.fields(cls) if f.default not in (None, msgspec.NODEFAULT))


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCallIn(_Body):
    function: FunctionCall
    id: str = ""
    type: str = "function"


class ChatMessage(_Body):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class FunctionDef(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    function: FunctionDef
    type: Literal["function"] = "function"


class NamedFunction(_Body):
    name: str


class ToolRef(_Body):
    function: NamedFunction
    type: Literal["function"] = "function"


class AllowedTools(_Body):
    mode: Literal["auto", "required"]
    tools: list[ToolRef]


class ToolChoiceObject(_Body):
    """``{"type": "function", "function": {"name": ...}}``: one call of that function; ``{"type": "allowed_tools",
    "allowed_tools": {"mode": ..., "tools": [...]}}``: ``mode`` with calls of those tools only (every tool stays in
    the prompt; :func:`~agentserve.gateway.chat_plan.allowed_tools_choice`)."""

    function: NamedFunction | None = None
    type: Literal["function", "allowed_tools"] = "function"
    allowed_tools: AllowedTools | None = None


class StreamOptions(_Body):
    include_usage: bool | None = False


class JsonSchemaFormat(_Body):
    name: str = "response"
    schema: dict[str, Any] | None = None  # None: not given (an object then); {}: any JSON value
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(_Body, kw_only=True):
    """Fields shared by chat and text completions."""

    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = 1
    logprobs: bool | int | None = None
    ignore_eos: bool | None = False
    frequency_penalty: float | None = None  # not implemented: only their neutral values are accepted
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceObject | None = None
    parallel_tool_calls: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[Any]  # a string, token ids, or a batch of either (checked by the handler)
    echo: bool | None = False
    best_of: int | None = None  # not implemented: only 1 is accepted
    suffix: str | None = None  # not implemented: only an empty one is accepted


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool | None = None  # unset: True for a prompt, False for messages (their template's), as vLLM
    add_generation_prompt: bool | None = True


class DetokenizeRequest(_Body):
    tokens: list[int]
    model: str | None = None


B = TypeVar("B", bound=_Body)

# field -> its neutral values: anything else asks for sampling this server does not do
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (None, 0.0), "presence_penalty": (None, 0.0), "repetition_penalty": (None, 1.0),
    "logit_bias": (None, {}), "best_of": (None, 1), "suffix": (None, ""),
}


def check_unsupported(req: _Body) -> None:
    """A 400 for a field that would change the output and that this server does not implement (silently ignoring
    it would answer something else than asked)."""
    for name, neutral in _UNSUPPORTED.items():
        if getattr(req, name, None) not in neutral:
            raise bad_request(f"`{name}` is not supported by this server (only {neutral[1]!r} is accepted)",
                              param=name, code="unsupported_parameter")


def decode_body(data: bytes, kind: type[B]) -> B:
    """``data`` (a JSON body) as ``kind``; a 400 naming the bad field otherwise."""
    try:
        return msgspec.json.decode(data, type=kind)
    except msgspec.ValidationError as e:
        param = _param_of(str(e))
        raise bad_request(f"invalid request: {e}", param=param) from None
    except msgspec.DecodeError as e:
        raise bad_request(f"the body is not valid JSON: {_why_not_json(data, e)}", code="invalid_json") from None
    except RecursionError:
        raise bad_request("the body is nested too deeply", code="invalid_json") from None


def _why_not_json(data: bytes, error: msgspec.DecodeError) -> str:
    """msgspec's reason, but for its one misleading case: a lone UTF-16 surrogate escape (``"\\ud800"``, which no
    UTF-8 text can hold) reads "Input data was truncated" in a body that is whole."""
    if "truncated" in str(error):
        try:
            json.loads(data)
        except ValueError:
            return str(error)
        return "a \\uD800-\\uDFFF escape without its pair (a lone surrogate is no Unicode text)"
    return str(error)


def _param_of(message: str) -> str | None:
    """``... - at `$.messages[0].role``` → ``messages[0].role``."""
    marker = "at `$."
    if marker not in message:
        return None
    return message.split(marker, 1)[1].rstrip("`")
