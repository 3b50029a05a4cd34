"""One running turn's output: scheduler token events in, client protocol events out.

Per token: incremental detokenisation (no broken UTF-8), stop strings (text held back while it may
still be the start of a stop string), timestamps.  At the end: the rest of the held text, parsed
tool calls, the finish reason, usage and timings.  The turn's raw output (special tokens kept, the
final eos dropped) becomes the assistant message of the conversation, so re-rendering the chat
reproduces exactly the tokens that are already in the KV cache.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from agentserve.orchestrator.text.detokenizer import IncrementalDetokenizer
from agentserve.orchestrator.text.stop_strings import StopStringMatcher
from agentserve.orchestrator.text.tokenization import Tokenizer
from agentserve.protocol.client_messages import (
    FinishReason,
    Timings,
    TokenEvent,
    ToolCallEvent,
    TopLogprobs,
    TurnDone,
    Usage,
)
from agentserve.protocol.sampling import Finish

_FINISH = {Finish.STOP: FinishReason.STOP, Finish.LENGTH: FinishReason.LENGTH, Finish.ABORT: FinishReason.ABORT}


@dataclass
class RunningTurn:
    req: int
    session: int
    seq_id: int
    tokenizer: Tokenizer
    stops: list[str]
    stop_token_ids: frozenset[int]
    parse_tools: bool
    arrival: float
    prompt: list[int]
    messages: list[dict[str, Any]]  # chat mode: the conversation the prompt was rendered from
    token_ids: list[int] = field(default_factory=list)
    first_token_t: float = 0.0
    last_token_t: float = 0.0
    stopped_by_string: bool = False
    text: str = ""  # everything sent to the client so far
    logprobs: bool = False  # token events carry logprobs (and the alternatives the scheduler passes on)

    def __post_init__(self) -> None:
        self._tool_calls: bool | None = None
        self._detok = IncrementalDetokenizer(self.tokenizer.decode, skip_special_tokens=True)
        self._stops = StopStringMatcher(self.stops) if self.stops else None

    def on_token(
        self, token_id: int, t: float, logprob: float = 0.0, top_ids: list[int] | None = None,
        top_logprobs: list[float] | None = None,
    ) -> TokenEvent | None:
        """The client event for one new token (None once a stop string has ended the text)."""
        if self.stopped_by_string:
            return None
        if not self.token_ids:
            self.first_token_t = t
        self.last_token_t = t
        self.token_ids.append(token_id)
        text = self._detok.add(token_id)
        if self._stops is not None:
            match = self._stops.feed(text)
            text = match.text
            self.stopped_by_string = match.stopped
        self.text += text
        event = TokenEvent(self.req, self.session, [token_id], text, t, time.time())
        if self.logprobs:
            event.logprobs = [logprob]
            if top_ids:
                event.top_logprobs = [TopLogprobs(list(top_ids), list(top_logprobs or ()))]
        return event

    def finish(
        self, reason: Finish, t: float, cached_tokens: int, served_t: float | None = None
    ) -> list[TokenEvent | ToolCallEvent | TurnDone]:
        """The closing events: held-back text, tool calls, then exactly one TurnDone (``served_t``: when the turn
        was first in a step, its queueing's end; None: never)."""
        events: list[TokenEvent | ToolCallEvent | TurnDone] = []
        tail = "" if self.stopped_by_string else self._detok.flush()
        if self._stops is not None and not self.stopped_by_string:
            match = self._stops.feed(tail)
            tail = match.text + ("" if match.stopped else self._stops.flush())
            self.stopped_by_string = self._stops.stopped  # completed by the held-back tail, or found in it
        if tail:
            self.text += tail
            events.append(TokenEvent(self.req, self.session, [], tail, t, time.time()))
        finish = FinishReason.STOP if self.stopped_by_string else _FINISH.get(reason, FinishReason.STOP)
        if self.parse_tools and finish != FinishReason.ABORT:
            calls = self.tokenizer.tool_call_format.parse(self.raw_text())
            self._tool_calls = bool(calls)
            for call in calls:
                call_id = f"call_{uuid.uuid4().hex[:12]}"
                events.append(ToolCallEvent(self.req, self.session, call_id, call.name, call.arguments, t, time.time()))
            if calls and finish != FinishReason.LENGTH:  # max_tokens may have cut a call short: say so
                finish = FinishReason.TOOL_CALLS
        events.append(
            TurnDone(self.req, self.session, finish, self.usage(cached_tokens), self.timings(t, served_t), t,
                     time.time())
        )
        return events

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def tool_calls_made(self) -> bool:
        """Whether the finished output holds a valid tool call (parsed once)."""
        if self._tool_calls is None:
            self._tool_calls = self.parse_tools and bool(self.tokenizer.tool_call_format.parse(self.raw_text()))
        return self._tool_calls

    def output_ids(self) -> list[int]:
        """Generated tokens that belong to the conversation: a final eos / stop token is dropped."""
        ids = self.token_ids
        if ids and ids[-1] in self.stop_token_ids:
            return ids[:-1]
        return ids

    def raw_text(self) -> str:
        """The output as the model wrote it (special tokens kept): the assistant message content."""
        if self.stopped_by_string:
            return self.text
        return self.tokenizer.decode(self.output_ids(), skip_special_tokens=False)

    def usage(self, cached_tokens: int) -> Usage:
        return Usage(self.prompt_tokens, cached_tokens, len(self.token_ids))

    def timings(self, t_done: float, served_t: float | None = None) -> Timings:
        n = len(self.token_ids)
        ttft = (self.first_token_t - self.arrival) * 1e3 if n else 0.0
        e2e = (t_done - self.arrival) * 1e3
        tpot = (e2e - ttft) / (n - 1) if n > 1 else 0.0
        queue = max(0.0, (served_t - self.arrival) * 1e3) if served_t is not None else 0.0
        return Timings(queue_ms=queue, ttft_ms=ttft, tpot_ms=tpot, e2e_ms=e2e)
