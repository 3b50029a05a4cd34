"""A reply's text → OpenAI deltas: content, and tool calls streamed by index as vLLM streams them.

Fed the reply's visible text as it is generated, a :class:`ReplyStreamer` re-scans it with the
checkpoint's tool-call format and sends only what is new: content up to where a tool call may start
(a tail that could be the start of ``<tool_call>`` is held back), then for each call one delta with its
id, type and name, then fragments of its arguments' JSON text.  :meth:`finish` sends the rest.

The non-streamed answer is the sum of these deltas, so streamed and non-streamed output are equal
by construction.  A reply that never got a valid call (and had no call's name sent) is all content.
With ``max_calls`` (``parallel_tool_calls: false``) the calls past it are left out of the answer and
:attr:`ReplyStreamer.dropped` says so.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from agentserve.orchestrator.text.tool_formats import CallText, ToolCallFormat


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ContentDelta:
    text: str


@dataclass
class CallDelta:
    index: int
    arguments: str
    id: str | None = None  # set on a call's first delta, with its name
    name: str | None = None


Delta = ContentDelta | CallDelta


@dataclass
class CallOut:
    id: str
    name: str
    arguments: str = ""


@dataclass
class ReplyStreamer:
    format: ToolCallFormat | None  # None: no tools, every character is content
    max_calls: int | None = None  # None: any number
    dropped: bool = False  # a call past max_calls was left out
    unfinished: bool = False  # at the end: a call that had started is not a complete, valid call (the reply was cut)
    text: str = ""
    content: str = ""  # content sent so far
    calls: list[CallOut] = field(default_factory=list)

    def feed(self, delta: str) -> list[Delta]:
        self.text += delta
        if self.format is None:
            return self._content(self.text)
        scan = self.format.scan(self.text, final=False)
        return self._apply(scan.calls, scan.content, final=False)

    def finish(self) -> list[Delta]:
        """The rest, once the reply is complete."""
        if self.format is None:
            return self._content(self.text)
        scan = self.format.scan(self.text, final=True)
        if not self.calls and not any(c.call is not None for c in scan.calls):
            return self._content(self.text)  # no tool call after all: the whole reply is content
        self.unfinished = any(c.call is None for c in scan.calls[:len(self.calls)])  # they started in order
        return self._apply(scan.calls, scan.content, final=True)

    def _content(self, safe: str) -> list[Delta]:
        if len(safe) <= len(self.content) or not safe.startswith(self.content):
            return []
        new, self.content = safe[len(self.content):], safe
        return [ContentDelta(new)]

    def _apply(self, calls: list[CallText], content: str, final: bool) -> list[Delta]:
        """Calls start in order: while streaming, a call whose name is not known yet holds back the rest;
        at the end, a call that never started and is not valid is dropped."""
        out = self._content(content)
        for i, c in enumerate(calls):
            if i >= len(self.calls):
                name = c.name if not final else (c.call.name if c.call is not None else None)
                if name is None:
                    if final:
                        continue
                    break
                if self.max_calls is not None and len(self.calls) >= self.max_calls:
                    self.dropped = True  # a call that would start past the limit: left out, and the rest
                    break
                self.calls.append(CallOut(new_call_id(), name))
                out.append(CallDelta(len(self.calls) - 1, "", self.calls[-1].id, name))
            target = self.calls[min(i, len(self.calls) - 1)]
            if c.args.startswith(target.arguments) and len(c.args) > len(target.arguments):
                out.append(CallDelta(self.calls.index(target), c.args[len(target.arguments):]))
                target.arguments = c.args
        return out

    @property
    def sent_chars(self) -> int:
        """How much of the text is sent: the content, a prefix of it, until a call starts (a tail that may start
        one is held back); then all of it (the calls' text goes out as their deltas)."""
        return len(self.text) if self.calls else len(self.content)

    @property
    def content_or_none(self) -> str | None:
        return self.content if self.content or not self.calls else None
