"""Streaming detokenisation: text deltas that never split a UTF-8 character.

A byte-level token may hold half a character; decoding it alone yields U+FFFD.  We decode a
small window ``ids[prefix:]`` and emit what it adds over ``ids[prefix:read]``; while the window's
text ends in U+FFFD the character is incomplete and the delta waits for the next token.  Diffing
a window (not decoding tokens one by one) also keeps SentencePiece-style leading spaces right.
Invariant: the concatenation of all deltas plus :meth:`flush` equals ``decode(all ids)``.
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"

DecodeFn = Callable[..., str]


class IncrementalDetokenizer:
    def __init__(self, decode: DecodeFn, skip_special_tokens: bool = True) -> None:
        self._decode = decode
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # everything emitted so far
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens before this index have been emitted

    def _window(self, start: int, end: int) -> str:
        return self._decode(self.ids[start:end], skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Append one token; return the newly complete text (possibly empty)."""
        self.ids.append(token_id)
        prefix_text = self._window(self._prefix, self._read)
        new_text = self._window(self._prefix, len(self.ids))
        if new_text.endswith(REPLACEMENT) or len(new_text) <= len(prefix_text):
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta

    def add_many(self, token_ids: list[int]) -> str:
        return "".join(self.add(t) for t in token_ids)

    def flush(self) -> str:
        """At the end of a stream: emit what is still held back (incomplete bytes become U+FFFD)."""
        prefix_text = self._window(self._prefix, self._read)
        new_text = self._window(self._prefix, len(self.ids))
        delta = new_text[len(prefix_text):]
        self._prefix = self._read = len(self.ids)
        self.text += delta
        return delta
