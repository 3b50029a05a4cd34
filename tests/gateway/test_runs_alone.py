"""Gateway runs driven without a server: a stream whose headers are sent ends an unexpected failure with an error
event and ``[DONE]`` (never a cut); a completion's session is filed under the tokens it holds."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from agentserve.gateway import chat


class _Run:
    def __init__(self) -> None:
        self.index, self.abandoned = 0, False
        self.backend = SimpleNamespace(metrics=None)

    def abandon(self) -> None:
        self.abandoned = True


def test_an_unexpected_error_mid_stream_is_an_error_event_then_done(monkeypatch) -> None:
    async def merged(runs):
        yield runs[0], None
        raise ValueError("a bug")

    monkeypatch.setattr(chat, "merged", merged)
    monkeypatch.setattr(_Run, "finish_reason", "stop", raising=False)
    monkeypatch.setattr(_Run, "logprobs_object", lambda self, final: None, raising=False)
    run = _Run()
    plan = SimpleNamespace(include_usage=False)

    async def collect() -> list[bytes]:
        return [b async for b in chat.stream([run], plan, {"id": "x"})]

    out = asyncio.run(collect())
    assert out[-1] == b"data: [DONE]\n\n"
    error = json.loads(out[-2].removeprefix(b"data: "))["error"]
    assert error["type"] == "server_error" and "ValueError" in error["message"]
    assert run.abandoned


def test_a_completion_ending_in_eos_is_filed_under_the_tokens_its_session_holds() -> None:
    """The orchestrator keeps a raw turn's output without its final eos; filed with it, a resent prompt + output +
    more continued the session with the eos silently dropped from the context."""
    from agentserve.client import Done, TokenIds
    from agentserve.gateway.completions import CompletionRun
    from agentserve.gateway.token_conversations import TokenConversationMap
    from agentserve.protocol.client_messages import FinishReason, Timings, Usage

    eos = 258
    backend = SimpleNamespace(token_conversations=TokenConversationMap(), close_later=lambda s: None, metrics=None,
                              require=lambda: (None, SimpleNamespace(eos_token_ids=[eos]), None))
    prompt, output = [5, 6, 7], [11, 12, eos]
    run = CompletionRun(backend, prompt, {})

    async def events():
        yield TokenIds(output, 0.0, 0.0)
        yield Done(FinishReason.STOP, Usage(3, 3, 0), Timings(0.0, 0.0, 0.0, 0.0))

    run.session, run._events = "the session", events()
    run._first = None

    async def drain() -> None:
        run._first = await run._events.__anext__()
        async for _ in run.events():
            pass

    asyncio.run(drain())
    session, held = backend.token_conversations.take(prompt + output + [13, 14])
    assert session == "the session" and held == len(prompt) + len(output) - 1, "the eos is among the new tokens"



def test_a_continued_conversation_refused_for_now_keeps_its_session() -> None:
    """A turn refused with `busy` (or while the executor restarts) never started: the session goes back to the map,
    so the retry the 503 invites continues it instead of re-sending (and re-tokenising) the whole conversation."""
    import pytest

    from agentserve.client import ServerBusy
    from agentserve.gateway.choice import ChoiceRun
    from agentserve.gateway.conversations import ConversationMap
    from agentserve.gateway.errors import APIError

    class Refusing:
        def turn(self, messages, **options):
            async def events():
                raise ServerBusy("busy: retry shortly")
                yield

            return events()

    closed: list = []
    digests = [b"system", b"user 1", b"assistant 1", b"user 2"]
    backend = SimpleNamespace(conversations=ConversationMap(), close_later=closed.append, metrics=None)
    plan = SimpleNamespace(digests=lambda extra=None: digests, messages_after=lambda k: ["user 2"],
                           choice_options=lambda index: {}, tool_format=None, max_calls=None, logprobs=False)
    session = Refusing()
    backend.conversations.file(b"assistant 1", session)
    with pytest.raises(APIError) as refused:
        asyncio.run(ChoiceRun(backend, plan, 0).start())
    assert refused.value.status == 503
    assert closed == [] and backend.conversations.take(digests) == (session, 3)
