"""A session's conversation as the server keeps it: messages (chat mode) or raw tokens.

The server, not the scheduler, is the conversation's source of truth, so a session outlives its KV
cache (an executor restart, an eviction).  Every turn is submitted as the *full* prompt; the
scheduler reuses whatever prefix is still cached.  In chat mode the prompt is the chat template
rendered over all messages, the model's own replies included verbatim, so the re-rendered prefix
is token-identical to what is cached.  In raw mode (benchmarks) the prompt is the previous tokens,
the model's output, and the turn's new token ids, after the templated system prompt and tools if
the session has them.  A session uses one mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from agentserve.orchestrator.text.tokenization import Tokenizer
from agentserve.protocol.client_messages import ErrorCode, ProtocolError, Turn


@dataclass
class Conversation:
    tokenizer: Tokenizer
    system: str | None = None  # None: no system message; "" an empty one (rendered, unlike None)
    tools: list[dict[str, Any]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # prompt + output of the turns so far
    raw: bool | None = None  # None until the first turn picks the mode
    # Chat mode: the rendered text that ``tokens`` stand for exactly (None: re-tokenize everything).
    exact_text: str | None = None
    _pending_text: str = ""  # the rendered prompt of the running turn

    def head(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": self.system}] if self.system is not None else []

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(self.head() + messages, self.tools or None, add_generation_prompt)

    def prompt_for(self, turn: Turn) -> tuple[list[int], list[dict[str, Any]]]:
        """The full prompt of ``turn`` and the message list it was rendered from."""
        raw = bool(turn.token_ids)
        if self.raw is not None and raw != self.raw:
            kind = "token_ids" if self.raw else "messages"
            raise ProtocolError(
                ErrorCode.INVALID_REQUEST,
                f"this session uses {kind}; a session cannot mix modes",
                turn.req,
                turn.session,
            )
        if raw:
            base = self.tokens or self.system_tokens()  # the first (successful) raw turn starts the conversation
            return base + list(turn.token_ids), self.messages
        messages = self.messages + [m.as_dict() for m in turn.messages]
        text = self._pending_text = self.render(messages, add_generation_prompt=True)
        if self.exact_text is not None and text.startswith(self.exact_text):
            # Keep the exact tokens of what is cached (re-tokenizing the model's output, e.g. a
            # split UTF-8 character, need not give them back); tokenize only what is new.
            return self.tokens + self._encode(text[len(self.exact_text) :]), messages
        return self._encode(text), messages

    def text_to_tokenize(self, turn: Turn) -> int:
        """About how many bytes of text :meth:`prompt_for` tokenizes for ``turn`` (the rule for doing it off the
        loop): the new messages, and the system prompt, tools and history too while nothing exact is cached."""
        head = len((self.system or "").encode()) + (len(msgspec.msgpack.encode(self.tools)) if self.tools else 0)
        if turn.token_ids:
            return 0 if self.tokens else head
        new = sum(m.text_bytes() for m in turn.messages)
        if self.exact_text is not None:
            return new
        return new + head + (len(msgspec.msgpack.encode(self.messages)) if self.messages else 0)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def commit(
        self,
        raw: bool,
        prompt: list[int],
        messages: list[dict[str, Any]],
        output_ids: list[int],
        text: str,
        exact: bool,
    ) -> None:
        """Record a finished turn: the prompt, the model's reply, and (chat) the reply as a message.

        ``exact``: ``text`` is exactly what ``output_ids`` decode to (not cut by a stop string).
        """
        self.raw = raw
        self.tokens = prompt + output_ids
        if raw:
            self.messages = messages
            return
        self.messages = [*messages, {"role": "assistant", "content": text}]
        spoken = self._pending_text + text
        # The template must render the reply verbatim after the prompt for the splice to be exact.
        try:
            verbatim = exact and self.render(self.messages, add_generation_prompt=False).startswith(spoken)
        except ValueError:  # a template that refuses to end on an assistant message
            verbatim = False
        self.exact_text = spoken if verbatim else None

    def system_tokens(self) -> list[int]:
        """The templated system prompt and tool schemas (empty without a system prompt: a template renders
        no conversation of zero messages, so tools alone come with the first turn's messages)."""
        if not self.head():
            return []
        return self._encode(self.render([], add_generation_prompt=False))
