"""A stream whose headers are sent ends an unexpected failure with an error event and ``[DONE]``, never a cut."""

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
    monkeypatch.setattr(_Run, "logprobs_object", lambda self, stream: None, raising=False)
    run = _Run()
    plan = SimpleNamespace(include_usage=False)

    async def collect() -> list[bytes]:
        return [b async for b in chat.stream([run], plan, {"id": "x"})]

    out = asyncio.run(collect())
    assert out[-1] == b"data: [DONE]\n\n"
    error = json.loads(out[-2].removeprefix(b"data: "))["error"]
    assert error["type"] == "server_error" and "ValueError" in error["message"]
    assert run.abandoned
