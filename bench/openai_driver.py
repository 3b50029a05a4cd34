"""Driver for stateless OpenAI-compatible completion servers (vLLM, SGLang, llama.cpp's llama-server).

These servers keep no conversation, so each turn resends the whole conversation as token ids
(prompt, generated tokens, tool outputs); their own prefix caches do the rest (``cache_prompt`` for
llama.cpp). Two dialects:

* ``openai``: ``POST /v1/completions`` with ``prompt`` as a list of ints, ``max_tokens``,
  ``ignore_eos``; output ids from ``choices[0].token_ids`` (vLLM with ``return_token_ids``), else one
  token per non-empty chunk.
* ``llamacpp``: llama.cpp's native ``POST /completion`` with ``n_predict`` and ``return_tokens``;
  the count comes from ``tokens_predicted`` (exact even when the server holds back a chunk that
  ends inside a UTF-8 character), the ids from ``tokens``.

Generated ids the server did not report are replaced by ``pad_id`` in the resent conversation, so
every system sees contexts of the same length (the server's cache then misses from that point).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from agentserve.bench.driver import Chunk
from agentserve.bench.http_sse import post_sse


def _openai_body(ids: list[int], max_tokens: int, model: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": ids, "max_tokens": max_tokens, "stream": True,
        "ignore_eos": True, "temperature": 0.0, "return_token_ids": True, "cache_prompt": True,
    }
    if model:
        body["model"] = model
    return body


def _openai_tokens(event: dict[str, Any], seen: int) -> tuple[list[int] | None, int]:
    choice = (event.get("choices") or [{}])[0]
    ids = choice.get("token_ids")
    if ids is not None:
        return list(ids), len(ids)
    return None, 1 if choice.get("text") else 0


def _llamacpp_body(ids: list[int], max_tokens: int, model: str | None) -> dict[str, Any]:
    return {"prompt": ids, "n_predict": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0.0, "cache_prompt": True, "return_tokens": True}


def _llamacpp_tokens(event: dict[str, Any], seen: int) -> tuple[list[int] | None, int]:
    ids = list(event.get("tokens") or [])
    n = int(event.get("tokens_predicted", seen + len(ids))) - seen
    return ids, max(n, 0)


DIALECTS = {
    "openai": ("/v1/completions", _openai_body, _openai_tokens),
    "llamacpp": ("/completion", _llamacpp_body, _llamacpp_tokens),
}


class OpenAISession:
    def __init__(self, url: str, dialect: str, model: str | None, pad_id: int,
                 extra_body: dict[str, Any]) -> None:
        self.url = url
        _, self._body, self._tokens = DIALECTS[dialect]
        self.model = model
        self.pad_id = pad_id
        self.extra_body = extra_body
        self.history: list[int] = []

    async def turn(self, prompt_ids: Sequence[int], max_tokens: int) -> AsyncIterator[Chunk]:
        self.history.extend(prompt_ids)
        seen = 0
        generated: list[int] = []
        body = self._body(list(self.history), max_tokens, self.model) | self.extra_body
        async for event in post_sse(self.url, body):
            t = time.perf_counter()
            ids, n = self._tokens(event, seen)
            if n <= 0:
                continue
            ids = (ids or [])[-n:]
            ids = [self.pad_id] * (n - len(ids)) + ids  # the unreported ids are the earlier ones
            seen += n
            generated.extend(ids)
            yield ids, t
        self.history.extend(generated)

    async def close(self) -> None:
        self.history.clear()


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

    async def open_session(self) -> OpenAISession:
        return OpenAISession(self.url, self.dialect, self.model, self.pad_id, self.extra_body)

    async def aclose(self) -> None:
        return None
