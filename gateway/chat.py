"""``POST /v1/chat/completions``: streamed (server-sent events) and whole answers.

Stream shape (as OpenAI and vLLM): one ``id`` for every chunk; first a chunk per choice with the role;
content and tool-call deltas (by ``index``: first the id, type and name, then argument fragments);
exactly one chunk per choice with its ``finish_reason``; with ``stream_options.include_usage`` every
chunk has ``"usage": null`` and a last chunk has ``choices: []`` and the usage; then ``data: [DONE]``.
A client that disconnects mid-stream aborts its turns at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from agentserve.gateway import sse
from agentserve.gateway.backend import Backend
from agentserve.gateway.body import read_body
from agentserve.gateway.chat_plan import ChatPlan, plan_chat
from agentserve.gateway.choice import ChoiceRun
from agentserve.gateway.errors import APIError, client_closed
from agentserve.gateway.reply_stream import ContentDelta, Delta
from agentserve.gateway.schemas import ChatCompletionRequest, decode_body
from agentserve.gateway.usage import usage_object


async def chat_completions(request: Request) -> Response:
    backend: Backend = request.app.state.backend
    req = decode_body(await read_body(request, backend.options.max_body_bytes), ChatCompletionRequest)
    plan = plan_chat(req, backend)
    runs = [ChoiceRun(backend, plan, i) for i in range(plan.n)]
    await unless_disconnected(request, start_choices(runs), runs)  # queued or prefilling: a client may give up
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": plan.model}
    if plan.stream:
        events = sse.counted(stream(runs, plan, head), backend.metrics)
        return StreamingResponse(events, media_type="text/event-stream", headers=sse.HEADERS)
    return JSONResponse(await unless_disconnected(request, whole(runs, head), runs))


async def unless_disconnected(request: Request, answer: Any, runs: list[ChoiceRun]) -> Any:
    """Await ``answer``; if the client disconnects first, abort the turns at once (a 499, never read)."""
    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(answer), asyncio.ensure_future(gone())
    try:
        await asyncio.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if work.done():
        return work.result()
    work.cancel()
    for run in runs:
        run.abandon()
    raise client_closed()


async def start_choices(runs: list[ChoiceRun]) -> None:
    results = await asyncio.gather(*(r.start() for r in runs), return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        for run in runs:
            run.abandon(count=False)  # the request is refused: its choices that started are no aborts
        raise failed[0]


async def whole(runs: list[ChoiceRun], head: dict[str, Any]) -> dict[str, Any]:
    async def drain(run: ChoiceRun) -> None:
        async for _ in run.deltas():
            pass

    try:
        await asyncio.gather(*(drain(r) for r in runs))
    except BaseException:
        for run in runs:
            run.abandon()
        raise
    choices = [{"index": r.index, "message": r.message(), "logprobs": r.logprobs_object(final=True),
                "finish_reason": r.finish_reason} for r in runs]
    usage = usage_object([r.done.usage for r in runs if r.done is not None])
    return {**head, "object": "chat.completion", "choices": choices, "usage": usage}


def delta_object(delta: Delta) -> dict[str, Any]:
    if isinstance(delta, ContentDelta):
        return {"content": delta.text}
    call: dict[str, Any] = {"index": delta.index}
    if delta.id is not None:
        call |= {"id": delta.id, "type": "function", "function": {"name": delta.name, "arguments": delta.arguments}}
    else:
        call["function"] = {"arguments": delta.arguments}
    return {"tool_calls": [call]}


Item = tuple[ChoiceRun, Delta | None, dict[str, Any] | None]


async def with_logprobs(run: ChoiceRun) -> AsyncIterator[Item]:
    """A choice's deltas, each with its ``logprobs`` taken as it is made (the text sent so far is the text up to
    it: a delta that waits in :func:`merged`'s queue must not list the tokens of the text after it); then
    ``(run, None, the rest)`` once the choice is done."""
    async for delta in run.deltas():
        yield run, delta, run.logprobs_object(final=False)
    yield run, None, run.logprobs_object(final=True)


async def merged(runs: list[ChoiceRun]) -> AsyncIterator[Item]:
    """Every choice's :func:`with_logprobs` items as they come."""
    if len(runs) == 1:
        async for item in with_logprobs(runs[0]):
            yield item
        return
    queue: asyncio.Queue[Item | BaseException] = asyncio.Queue()

    async def pump(run: ChoiceRun) -> None:
        try:
            async for item in with_logprobs(run):
                queue.put_nowait(item)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait(e)

    tasks = [asyncio.create_task(pump(r)) for r in runs]
    try:
        for _ in range(len(runs)):
            while (item := await queue.get()) and not isinstance(item, BaseException) and item[1] is not None:
                yield item
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def stream(runs: list[ChoiceRun], plan: ChatPlan, head: dict[str, Any]) -> AsyncIterator[bytes]:
    head = {**head, "object": "chat.completion.chunk"}
    extra = {"usage": None} if plan.include_usage else {}

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return sse.event({**head, "choices": [choice], **extra})

    try:
        for run in runs:
            yield chunk(run.index, {"role": "assistant", "content": ""})
        async for run, delta, logprobs in merged(runs):
            body = {} if delta is None else delta_object(delta)
            finish = run.finish_reason if delta is None else None
            yield chunk(run.index, body, finish, logprobs)
        if plan.include_usage:
            usage = usage_object([r.done.usage for r in runs if r.done is not None])
            yield sse.event({**head, "choices": [], "usage": usage})
    except APIError as e:
        yield sse.event(e.body())
    except Exception as e:  # noqa: BLE001 - the headers are sent: the client learns of it by an error event
        yield sse.event(sse.server_error(e).body())
    finally:
        for run in runs:
            run.abandon()  # a choice still running here lost its client: abort it now
    yield sse.DONE
