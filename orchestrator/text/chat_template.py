"""Chat templates rendered with jinja2 exactly the way Hugging Face transformers renders them.

Same sandbox (``ImmutableSandboxedEnvironment``), ``trim_blocks`` / ``lstrip_blocks``, the
``loopcontrols`` extension, a ``tojson`` filter that does not HTML-escape, and the globals
``raise_exception``, ``strftime_now``, ``dict`` and ``namespace``.  Messages whose values are
``None`` lose those keys first (as transformers does); tools are passed as a list of JSON schemas;
the tokenizer's named special tokens (``bos_token``, ``eos_token``, ...) are template variables.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The chat template is missing, does not compile, or rejected the conversation."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict`` for templates without attribute access to the real type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """``namespace`` that refuses underscore names (no route to interpreter internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's own signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"templates cannot set underscore attribute {name!r}")


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks): render as-is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from None


def _plain(value: Any) -> Any:
    """Rebuild ``value`` from plain JSON types so the sandbox only ever sees inert data."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    for base in (bool, str, int, float):
        if isinstance(value, base):
            return base(value)
    return f"<{type(value).__name__}>"


def _normalize(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        if not isinstance(m, dict):
            raise ChatTemplateError(f"chat messages must be dicts, got {type(m).__name__}")
        out.append({k: _plain(v) for k, v in m.items() if v is not None})
    return out


def select_template(templates: dict[str, str], tools: list | None) -> str:
    """Pick the named template the way transformers does: ``tool_use`` when tools are given."""
    if not templates:
        raise ChatTemplateError("this model has no chat template (tokenizer_config.json has no chat_template)")
    if tools and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    if len(templates) == 1:
        return next(iter(templates.values()))
    raise ChatTemplateError(f"no default chat template among {sorted(templates)}")


def render(
    source: str,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    special_tokens: dict[str, str] | None = None,
    **kwargs: Any,
) -> str:
    """Render ``messages`` (and ``tools``, JSON schemas) with the template ``source``."""
    if not messages:
        raise ChatTemplateError("cannot apply a chat template to an empty conversation")
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise ChatTemplateError("tools must be JSON schemas (dicts)")
    variables = {**(special_tokens or {}), **kwargs}
    try:
        return compile_template(source).render(
            messages=_normalize(messages),
            tools=_plain(tools),
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **_plain(variables),
        )
    except Exception as e:  # the template is untrusted code: any failure is the conversation's or its own
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
