"""Driver for stateless OpenAI-compatible servers (vLLM, SGLang, llama.cpp's llama-server, a router).

These servers keep no conversation, so each turn resends the whole conversation (prompt, generated
tokens, tool outputs); their own prefix caches do the rest (``cache_prompt`` for llama.cpp). Three
dialects:

* ``openai``: ``POST /v1/completions`` with ``prompt`` as a list of ints, ``max_tokens``,
  ``ignore_eos``; output ids from ``choices[0].token_ids`` (vLLM with ``return_token_ids``), else one
  token per non-empty chunk, topped up from the usage chunk (a server that sends several tokens in a chunk).
* ``llamacpp``: llama.cpp's native ``POST /completion`` with ``n_predict`` and ``return_tokens``;
  the count comes from ``tokens_predicted`` (exact even when the server holds back a chunk that
  ends inside a UTF-8 character), the ids from ``tokens``.
* ``chat``: ``POST /v1/chat/completions`` with the conversation as text messages, for what accepts no
  token ids (the SGLang Model Gateway's ``/v1/completions`` takes strings only). Each workload token
  is one ASCII letter or digit (:func:`ids_to_text`): one token each on the byte-level built-in models,
  fewer on a BPE vocabulary. A turn is a user message; the reply is resent exactly as answered (so a
  server that keys conversations by their messages continues them). The count is one token per
  non-empty content chunk, topped up from the usage chunk (a token held back inside a UTF-8 character).

In every dialect a stream that ends before the server said it finished (``finish_reason``; llama.cpp's
``stop``) is an error: a server that died mid-reply gave no answer.

Generated ids the server did not report are replaced by ``pad_id`` in the resent conversation, so
every system sees contexts of the same length (the server's cache then misses from that point).
"""

from __future__ import annotations

import json
import string
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from agentserve.bench.driver import Chunk
from agentserve.bench.http_sse import HTTPError, get, post_sse

TEXT_ALPHABET = string.ascii_letters + string.digits


def ids_to_text(ids: Sequence[int]) -> str:
    """One ASCII letter or digit per token id (deterministic, so a resent conversation is identical)."""
    return "".join(TEXT_ALPHABET[i % len(TEXT_ALPHABET)] for i in ids)


def _openai_body(ids: list[int], max_tokens: int, model: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": ids, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
        "ignore_eos": True, "temperature": 0.0, "return_token_ids": True, "cache_prompt": True,
    }
    if model:
        body["model"] = model
    return body


def _usage_top_up(event: dict[str, Any], seen: int, own: int) -> int:
    """The tokens a chunk stands for: the ``own`` it carries, or more where it has OpenAI's usage (a chunk of its
    own, or the last one's: llama-server) — the tokens no chunk carried until then are counted there."""
    usage = event.get("usage")
    if not usage:
        return own
    return max(own, int(usage.get("completion_tokens", seen)) - seen)


def _openai_finished(event: dict[str, Any]) -> bool:
    choices = event.get("choices") or []
    return bool(choices and choices[0].get("finish_reason"))


def _unfinished(seen: int) -> ConnectionError:
    return ConnectionError(f"the reply stream ended after {seen} tokens before the server finished it")


def _openai_tokens(event: dict[str, Any], seen: int) -> tuple[list[int] | None, int]:
    choice = (event.get("choices") or [{}])[0]
    ids = choice.get("token_ids")
    own = len(ids) if ids is not None else 1 if choice.get("text") else 0
    return (None if ids is None else list(ids)), _usage_top_up(event, seen, own)


def _llamacpp_body(ids: list[int], max_tokens: int, model: str | None) -> dict[str, Any]:
    return {"prompt": ids, "n_predict": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0.0, "cache_prompt": True, "return_tokens": True}


def _llamacpp_tokens(event: dict[str, Any], seen: int) -> tuple[list[int] | None, int]:
    ids = list(event.get("tokens") or [])
    n = int(event.get("tokens_predicted", seen + len(ids))) - seen
    return ids, max(n, 0)


DIALECTS = {
    "openai": ("/v1/completions", _openai_body, _openai_tokens, _openai_finished),
    "llamacpp": ("/completion", _llamacpp_body, _llamacpp_tokens, lambda event: bool(event.get("stop"))),
    "chat": ("/v1/chat/completions", None, None, None),  # ChatSession
}


class OpenAISession:
    def __init__(self, url: str, dialect: str, model: str | None, pad_id: int,
                 extra_body: dict[str, Any]) -> None:
        self.url = url
        _, self._body, self._tokens, self._finished = DIALECTS[dialect]
        self.model = model
        self.pad_id = pad_id
        self.extra_body = extra_body
        self.history: list[int] = []

    async def turn(self, prompt_ids: Sequence[int], max_tokens: int) -> AsyncIterator[Chunk]:
        self.history.extend(prompt_ids)
        seen, finished = 0, False
        generated: list[int] = []
        body = self._body(list(self.history), max_tokens, self.model) | self.extra_body
        async for event in post_sse(self.url, body):
            t = time.perf_counter()
            finished = finished or self._finished(event)
            ids, n = self._tokens(event, seen)
            if n <= 0:
                continue
            ids = (ids or [])[-n:]
            ids = [self.pad_id] * (n - len(ids)) + ids  # the unreported ids are the earlier ones
            seen += n
            generated.extend(ids)
            yield ids, t
        if not finished:
            raise _unfinished(seen)
        self.history.extend(generated)

    async def close(self) -> None:
        self.history.clear()


class ChatSession:
    """The ``chat`` dialect: the conversation as messages, each reply resent exactly as answered."""

    def __init__(self, url: str, model: str | None, pad_id: int, extra_body: dict[str, Any]) -> None:
        self.url, self.model, self.pad_id, self.extra_body = url, model, pad_id, extra_body
        self.messages: list[dict[str, Any]] = []

    def _body(self, max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "messages": list(self.messages), "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0,
        }
        if self.model:
            body["model"] = self.model
        return body | self.extra_body

    async def turn(self, prompt_ids: Sequence[int], max_tokens: int) -> AsyncIterator[Chunk]:
        self.messages.append({"role": "user", "content": ids_to_text(prompt_ids)})
        seen, reply, finished = 0, [], False
        async for event in post_sse(self.url, self._body(max_tokens)):
            t = time.perf_counter()
            choices = event.get("choices") or []
            text = (choices[0].get("delta") or {}).get("content") if choices else None
            finished = finished or _openai_finished(event)
            n = _usage_top_up(event, seen, 1 if text else 0)
            if text:
                reply.append(text)
            if n:
                seen += n
                yield [self.pad_id] * n, t
        if not finished:  # the connection broke mid-reply (a server that died): not an answer
            raise _unfinished(seen)
        self.messages.append({"role": "assistant", "content": "".join(reply)})

    async def close(self) -> None:
        self.messages.clear()


class OpenAIDriver:
    """Stateless-server driver; ``base_url`` like ``http://127.0.0.1:8080``.

    ``extra_body`` is merged into every request (e.g. llama.cpp's ``logit_bias``).
    """

    def __init__(self, base_url: str, *, dialect: str = "openai", model: str | None = None,
                 pad_id: int = 10, name: str = "target", extra_body: dict[str, Any] | None = None) -> None:
        if dialect not in DIALECTS:
            raise ValueError(f"unknown dialect {dialect!r}; one of {sorted(DIALECTS)}")
        self.url = base_url.rstrip("/") + DIALECTS[dialect][0]
        self.dialect = dialect
        self.model = model
        self.pad_id = pad_id
        self.name = name
        self.extra_body = dict(extra_body or {})

    async def connect(self) -> None:
        """For ``chat`` without a model name: the first model the server lists (chat needs one)."""
        if self.dialect != "chat" or self.model:
            return
        models_url = self.url.removesuffix(DIALECTS["chat"][0]) + "/v1/models"
        status, body = await get(models_url)
        if status != 200:
            raise HTTPError(status, body.decode("utf-8", "replace"))
        self.model = json.loads(body)["data"][0]["id"]

    async def open_session(self) -> OpenAISession | ChatSession:
        if self.dialect == "chat":
            return ChatSession(self.url, self.model, self.pad_id, self.extra_body)
        return OpenAISession(self.url, self.dialect, self.model, self.pad_id, self.extra_body)

    async def aclose(self) -> None:
        return None
