"""The conversation map of raw-token sessions (``/v1/completions`` with token ids): idle sessions keyed
by the exact tokens they hold (prompt and output).  A prompt that starts with a filed session's tokens
continues that session with only the tokens after them.

Each filed sequence is keyed by its length and a BLAKE2 digest of its tokens.  A lookup first keeps the filed
lengths ``n`` at which some filed sequence ends in the prompt's token ``n - 1`` (a set lookup per length), then
hashes the prompt once, front to back, taking a digest at each kept length on the way, and takes the longest
hit whose tokens really match: one pass over the prompt, whatever the map holds, and a miss (a new
conversation) costs what a hit does.  The map is bounded like
:class:`~agentserve.gateway.conversations.ConversationMap`.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

Key = tuple[int, bytes]  # (length, digest of the tokens)


class TokenConversationMap:
    def __init__(self, capacity: int = 4096, idle_s: float = 600.0, clock: Callable[[], float] = time.monotonic,
                 on_evict: Callable[[Any], None] = lambda session: None) -> None:
        self.capacity = capacity
        self.idle_s = idle_s
        self._clock = clock
        self._on_evict = on_evict
        self._map: OrderedDict[Key, tuple[Any, list[int], float]] = OrderedDict()  # session, tokens, filed at
        self._ends: dict[int, dict[int, int]] = {}  # filed length → last token → how many entries end so

    def __len__(self) -> int:
        return len(self._map)

    def take(self, prompt: list[int]) -> tuple[Any, int] | None:
        """The session holding the longest filed strict prefix of ``prompt`` and its length (it leaves the map)."""
        lengths = sorted(n for n, ends in self._ends.items() if n < len(prompt) and _end(prompt, n) in ends)
        for key in reversed([k for k in _prefix_keys(prompt, lengths) if k in self._map]):
            n = key[0]
            if self._map[key][1] == prompt[:n]:
                return self._pop(key), n
        return None

    def file(self, tokens: list[int], session: Any) -> None:
        (key,) = _prefix_keys(tokens, [len(tokens)])
        if key in self._map:
            self._on_evict(self._pop(key))
        self._map[key] = (session, list(tokens), self._clock())
        ends = self._ends.setdefault(key[0], {})
        ends[_end(tokens, key[0])] = ends.get(_end(tokens, key[0]), 0) + 1
        while len(self._map) > self.capacity:
            self._on_evict(self._pop(next(iter(self._map))))

    def oldest_filed_at(self) -> float | None:
        return next(iter(self._map.values()))[2] if self._map else None

    def pop_oldest(self) -> Any:
        """The session filed longest ago (it leaves the map); the map must not be empty."""
        return self._pop(next(iter(self._map)))

    def sweep(self) -> int:
        """Close the sessions idle for ``idle_s``; returns how many."""
        cutoff = self._clock() - self.idle_s
        n = 0
        while self._map:
            key = next(iter(self._map))
            if self._map[key][2] > cutoff:
                break
            self._on_evict(self._pop(key))
            n += 1
        return n

    def _pop(self, key: Key) -> Any:
        session, tokens, _ = self._map.pop(key)
        ends, end = self._ends[key[0]], _end(tokens, key[0])
        ends[end] -= 1
        if not ends[end]:
            del ends[end]
            if not ends:
                del self._ends[key[0]]
        return session

    def drain(self) -> list[Any]:
        sessions = [s for s, _, _ in self._map.values()]
        self._map.clear()
        self._ends.clear()
        return sessions


def _end(tokens: list[int], n: int) -> int:
    """The last token of ``tokens[:n]`` (-1 for none)."""
    return tokens[n - 1] if n else -1


def _prefix_keys(tokens: list[int], lengths: list[int]) -> list[Key]:
    """The key of ``tokens[:n]`` for each ``n`` of the ascending ``lengths`` (each at most ``len(tokens)``)."""
    data = memoryview(array("Q", tokens)).cast("B")  # ids >= 0 (prompt_ids checks) of 64 bits (JSON decoding's)
    width = data.itemsize * 8
    running, done, keys = hashlib.blake2b(digest_size=16), 0, []
    for n in lengths:
        running.update(data[done * width : n * width])
        done = n
        keys.append((n, running.copy().digest()))
    return keys
