"""The conversation map of raw-token sessions (``/v1/completions`` with token ids): idle sessions keyed
by the exact tokens they hold (prompt and output).  A prompt that starts with a filed session's tokens
continues that session with only the tokens after them.

Lookups try each distinct filed length, longest first, comparing a hash of the prompt's prefix and then
the tokens themselves; the map is bounded like :class:`~agentserve.gateway.conversations.ConversationMap`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any


class TokenConversationMap:
    def __init__(self, capacity: int = 4096, idle_s: float = 600.0, clock: Callable[[], float] = time.monotonic,
                 on_evict: Callable[[Any], None] = lambda session: None) -> None:
        self.capacity = capacity
        self.idle_s = idle_s
        self._clock = clock
        self._on_evict = on_evict
        self._map: OrderedDict[tuple[int, int], tuple[Any, list[int]]] = OrderedDict()  # in the order filed
        self._filed_at: dict[tuple[int, int], float] = {}
        self._lengths: dict[int, int] = {}  # filed length → how many entries have it

    def __len__(self) -> int:
        return len(self._map)

    def take(self, prompt: list[int]) -> tuple[Any, int] | None:
        """The session holding the longest filed strict prefix of ``prompt`` and its length (it leaves the map)."""
        for n in sorted((n for n in self._lengths if n < len(prompt)), reverse=True):
            key = (n, hash(tuple(prompt[:n])))
            filed = self._map.get(key)
            if filed is not None and filed[1] == prompt[:n]:
                self._pop(key)
                return filed[0], n
        return None

    def file(self, tokens: list[int], session: Any) -> None:
        key = (len(tokens), hash(tuple(tokens)))
        if key in self._map:
            self._on_evict(self._pop(key)[0])
        self._map[key] = (session, list(tokens))
        self._filed_at[key] = self._clock()
        self._lengths[len(tokens)] = self._lengths.get(len(tokens), 0) + 1
        while len(self._map) > self.capacity:
            self._on_evict(self._pop(next(iter(self._map)))[0])

    def sweep(self) -> int:
        """Close the sessions idle for ``idle_s``; returns how many."""
        cutoff = self._clock() - self.idle_s
        n = 0
        while self._map:
            key = next(iter(self._map))
            if self._filed_at[key] > cutoff:
                break
            self._on_evict(self._pop(key)[0])
            n += 1
        return n

    def _pop(self, key: tuple[int, int]) -> tuple[Any, list[int]]:
        filed = self._map.pop(key)
        del self._filed_at[key]
        left = self._lengths[key[0]] - 1
        if left:
            self._lengths[key[0]] = left
        else:
            del self._lengths[key[0]]
        return filed

    def drain(self) -> list[Any]:
        sessions = [s for s, _ in self._map.values()]
        self._map.clear()
        self._filed_at.clear()
        self._lengths.clear()
        return sessions
