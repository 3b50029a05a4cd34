"""The conversation map: idle orchestrator sessions keyed by the conversation they hold.

OpenAI clients resend the whole conversation every turn.  After a turn, the gateway files the
session under the digest of the conversation as the client will send it next time: the request's
messages plus the assistant reply exactly as it was answered (its content and its tool calls with
their ids).  A request whose messages start with a filed conversation takes that session out of the
map and sends only the messages after it as the session's next turn, so a tool result becomes a
resume prefill of the new tokens and the orchestrator's KV pin covers the agent's tool time.

Digests chain message by message (``d_i = H(d_{i-1}, message_i)``), seeded with what else must match
(the model, the tools), so the longest filed prefix is found in one pass.  A session is in the map at
most once and is taken out while a turn runs on it.  The map is bounded: the session idle longest is
closed first, and sessions idle for ``idle_s`` are closed by :meth:`sweep`.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from agentserve.gateway.messages import Canonical


def chain(seed: bytes, messages: Iterable[Canonical]) -> list[bytes]:
    """``[d_1, ..., d_n]``: the digest of each prefix of ``messages``."""
    out = []
    digest = hashlib.blake2b(seed, digest_size=20).digest()
    for m in messages:
        digest = hashlib.blake2b(digest + m.encode(), digest_size=20).digest()
        out.append(digest)
    return out


@dataclass
class Filed:
    session: Any  # an agentserve.client.AsyncSession
    filed_at: float


class ConversationMap:
    def __init__(self, capacity: int = 4096, idle_s: float = 600.0, clock: Callable[[], float] = time.monotonic,
                 on_evict: Callable[[Any], None] = lambda session: None) -> None:
        self.capacity = capacity
        self.idle_s = idle_s
        self._clock = clock
        self._on_evict = on_evict  # closes the evicted session (frees its KV)
        self._map: OrderedDict[bytes, Filed] = OrderedDict()

    def __len__(self) -> int:
        return len(self._map)

    def take(self, digests: list[bytes]) -> tuple[Any, int] | None:
        """The session holding the longest filed prefix that leaves at least one new message, and how
        many messages it holds; the session leaves the map (None: no prefix is filed)."""
        for k in range(len(digests) - 1, 0, -1):
            filed = self._map.pop(digests[k - 1], None)
            if filed is not None:
                return filed.session, k
        return None

    def file(self, digest: bytes, session: Any) -> None:
        """File an idle ``session`` under the conversation digest it holds."""
        old = self._map.pop(digest, None)
        if old is not None and old.session is not session:
            self._on_evict(old.session)  # the same conversation twice (n > 1, retries): keep the newest
        self._map[digest] = Filed(session, self._clock())
        while len(self._map) > self.capacity:
            _, evicted = self._map.popitem(last=False)
            self._on_evict(evicted.session)

    def oldest_filed_at(self) -> float | None:
        return next(iter(self._map.values())).filed_at if self._map else None

    def pop_oldest(self) -> Any:
        """The session filed longest ago (it leaves the map); the map must not be empty."""
        return self._map.popitem(last=False)[1].session

    def sweep(self) -> int:
        """Close the sessions idle for ``idle_s``; returns how many."""
        cutoff = self._clock() - self.idle_s
        n = 0
        while self._map:
            digest, filed = next(iter(self._map.items()))
            if filed.filed_at > cutoff:
                break
            del self._map[digest]
            self._on_evict(filed.session)
            n += 1
        return n

    def drain(self) -> list[Any]:
        """Every filed session (the map is left empty)."""
        sessions = [f.session for f in self._map.values()]
        self._map.clear()
        return sessions
