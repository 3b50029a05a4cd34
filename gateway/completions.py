"""``POST /v1/completions``: a prompt as a string or as token ids, run as a raw-token turn (no chat
template).  A prompt that extends a finished completion's prompt and output continues its session
(benchmarks and stateless agents resend the whole history), so only the new tokens are prefilled.
``return_token_ids`` (vLLM's extension) adds each chunk's token ids.  ``logprobs: k`` (0–20) adds the
legacy logprobs object; its ``text_offset`` counts from the completion's start, and a chunk lists the tokens
that start in the text sent so far.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from agentserve.client import AgentServeError, Done, TextDelta, TokenIds
from agentserve.gateway import sse
from agentserve.gateway.backend import Backend
from agentserve.gateway.body import read_body
from agentserve.gateway.chat import unless_disconnected
from agentserve.gateway.chat_plan import sampling_options
from agentserve.gateway.errors import APIError, bad_request, from_client_error
from agentserve.gateway.limits import check_prompt_text
from agentserve.gateway.logprobs import LogprobLog, completion_options
from agentserve.gateway.schemas import CompletionRequest, decode_body
from agentserve.gateway.turn_timer import TurnTimer, count_abandoned
from agentserve.gateway.usage import usage_object
from agentserve.protocol.client_messages import FinishReason


class ExtraFields(CompletionRequest, kw_only=True):
    return_token_ids: bool | None = False


def prompt_ids(req: CompletionRequest, backend: Backend) -> list[int]:
    """The prompt's token ids (the orchestrator checks them against the model's vocabulary and the context).  A text
    prompt longer than the context is refused here, as the orchestrator would: sent on as ids, one of more than
    ``max_token_ids`` would be refused by that limit instead, which the client did not use."""
    _, welcome, tokenizer = backend.require()
    prompt = req.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        check_prompt_text(prompt, backend.limits)
        ids = tokenizer.encode(prompt, add_special_tokens=True)
        if len(ids) >= welcome.max_model_len:
            held = welcome.max_model_len - 1
            raise bad_request(f"the prompt is {len(ids)} tokens; this server's context holds {held}", param="prompt",
                              code="context_length_exceeded")
    elif prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    else:
        raise bad_request("prompt must be a string or a list of token ids (one prompt per request)", param="prompt")
    if not ids:
        raise bad_request("the prompt is empty", param="prompt")
    if any(t < 0 for t in ids):
        raise bad_request("token ids must be >= 0", param="prompt")
    return ids


class CompletionRun:
    """One raw-token turn; its session is filed under prompt + output when it completes."""

    def __init__(self, backend: Backend, prompt: list[int], options: dict[str, Any]) -> None:
        self.backend, self.prompt, self.options = backend, prompt, options
        self.session: Any = None
        self.done: Done | None = None
        self.output: list[int] = []
        self.text = ""
        self.logprobs = LogprobLog(backend.require()[2]) if options.get("logprobs") else None
        self.resumed = False
        self.timer = TurnTimer()
        self._events: Any = None
        self._first: Any = None

    async def start(self) -> None:
        self.backend.require()
        taken = self.backend.token_conversations.take(self.prompt)
        if taken is not None:
            self.session, held = taken
            self.resumed = True
            new = self.prompt[held:]
        else:
            try:
                self.session = await self.backend.open_session(name="http-completions", parse_tool_calls=False)
            except AgentServeError as e:
                raise from_client_error(e) from None
            new = self.prompt
        self._events = self.session.turn(token_ids=new, **self.options).__aiter__()
        try:
            self._first = await self._events.__anext__()
        except AgentServeError as e:
            session, self.session = self.session, None  # refused before it started: not counted as an abort
            self.backend.close_later(session)
            raise from_client_error(e) from None

    async def events(self) -> AsyncIterator[Any]:
        event, self._first = self._first, None
        try:
            while True:
                if isinstance(event, TokenIds):
                    self.timer.on_tokens(event)
                    self.output += event.token_ids
                    if self.logprobs is not None:
                        self.logprobs.add(event)
                elif isinstance(event, TextDelta):
                    self.text += event.text
                elif isinstance(event, Done):
                    self.done = event
                yield event
                if self.done is not None:
                    break
                event = await self._events.__anext__()
        except AgentServeError as e:
            self.abandon()
            raise from_client_error(e) from None
        session, self.session = self.session, None
        aborted = self.done.finish == FinishReason.ABORT
        self.timer.observe(self.backend.metrics, self.done, self.resumed, "abort" if aborted else self.finish_reason)
        if aborted:
            self.backend.close_later(session)
        else:
            self.backend.token_conversations.file(self.prompt + self._kept_output(), session)

    def _kept_output(self) -> list[int]:
        """The output tokens the session holds: a final eos (the server's, from its welcome) is not part of it
        (``RunningTurn.output_ids``), so a prompt that resends it continues the session with it among the new ones."""
        _, welcome, _ = self.backend.require()
        if self.output and self.output[-1] in welcome.eos_token_ids:
            return self.output[:-1]
        return self.output

    def abandon(self) -> None:
        session, self.session = self.session, None
        count_abandoned(self.backend.metrics, session)
        if session is not None:
            self.backend.close_later(session)

    @property
    def finish_reason(self) -> str:
        return "length" if self.done is not None and self.done.finish == FinishReason.LENGTH else "stop"


async def completions(request: Request) -> Response:
    backend: Backend = request.app.state.backend
    body = await read_body(request, backend.options.max_body_bytes)
    req = decode_body(body, ExtraFields)
    backend.require()
    backend.check_model(req.model)
    if req.n != 1:
        raise bad_request("this server supports n=1 on /v1/completions", param="n")
    if req.echo:
        raise bad_request("this server does not echo the prompt on /v1/completions", param="echo")
    options = sampling_options(req, 16 if req.max_tokens is None else req.max_tokens, backend)
    options |= completion_options(req.logprobs)
    text = isinstance(req.prompt, str) or any(isinstance(p, str) for p in req.prompt[:1])
    ids = await backend.tokenizing.run(len(body) if text else 0, lambda: prompt_ids(req, backend))  # ids: no work
    run = CompletionRun(backend, ids, options)
    await unless_disconnected(request, run.start(), [run])  # queued or prefilling: a client may give up
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": backend.model_name}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        events = sse.counted(stream(run, head, req.return_token_ids, include_usage), backend.metrics)
        return StreamingResponse(events, media_type="text/event-stream", headers=sse.HEADERS)
    return JSONResponse(await unless_disconnected(request, whole(run, head, req.return_token_ids), [run]))


async def whole(run: CompletionRun, head: dict[str, Any], with_ids: bool) -> dict[str, Any]:
    async for _ in run.events():
        pass
    logprobs = run.logprobs.take_legacy(len(run.text), final=True) if run.logprobs is not None else None
    choice = {"index": 0, "text": run.text, "logprobs": logprobs, "finish_reason": run.finish_reason}
    if with_ids:
        choice["token_ids"] = run.output
    return {**head, "choices": [choice], "usage": usage_object([run.done.usage])}


async def stream(run: CompletionRun, head: dict[str, Any], with_ids: bool, include_usage: bool
                 ) -> AsyncIterator[bytes]:
    def chunk(text: str, ids: list[int] | None, finish: str | None = None) -> bytes:
        with_logprobs = run.logprobs is not None and (text or finish)
        logprobs = run.logprobs.take_legacy(len(run.text), final=finish is not None) if with_logprobs else None
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if with_ids:
            choice["token_ids"] = ids or []
        return sse.event({**head, "choices": [choice], **({"usage": None} if include_usage else {})})

    try:
        async for event in run.events():
            if isinstance(event, TokenIds) and with_ids and event.token_ids:
                yield chunk("", event.token_ids)
            elif isinstance(event, TextDelta) and event.text:
                yield chunk(event.text, None)
        yield chunk("", None, run.finish_reason)
        if include_usage:
            yield sse.event({**head, "choices": [], "usage": usage_object([run.done.usage])})
    except APIError as e:
        yield sse.event(e.body())
    except Exception as e:  # noqa: BLE001 - the headers are sent: the client learns of it by an error event
        yield sse.event(sse.server_error(e).body())
    finally:
        run.abandon()
    yield sse.DONE
