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

from agentserve.orchestrator.protocol import ErrorCode, Message, ProtocolError, Turn
from agentserve.orchestrator.tokenization import Tokenizer


def message_dict(m: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    return out


@dataclass
class Conversation:
    system: str = ""
    tools: list[dict[str, Any]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # prompt + output of the turns so far
    raw: bool | None = None  # None until the first turn picks the mode

    def head(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": self.system}] if self.system else []

    def prompt_for(self, turn: Turn, tokenizer: Tokenizer) -> tuple[list[int], list[dict[str, Any]]]:
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
            base = self.tokens if self.raw is not None else self.system_tokens(tokenizer)
            return base + list(turn.token_ids), self.messages
        messages = self.messages + [message_dict(m) for m in turn.messages]
        prompt = tokenizer.encode_chat(self.head() + messages, self.tools or None, add_generation_prompt=True)
        return prompt, messages

    def commit(
        self, raw: bool, prompt: list[int], messages: list[dict[str, Any]], output_ids: list[int], text: str
    ) -> None:
        """Record a finished turn: the prompt, the model's reply, and (chat) the reply as a message."""
        self.raw = raw
        self.tokens = prompt + output_ids
        self.messages = messages if raw else [*messages, {"role": "assistant", "content": text}]

    def system_tokens(self, tokenizer: Tokenizer) -> list[int]:
        """The templated system prompt and tool schemas (empty without either)."""
        head = self.head()
        if not head and not self.tools:
            return []
        return tokenizer.encode_chat(head, self.tools or None, add_generation_prompt=False)
