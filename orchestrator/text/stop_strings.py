"""Stop strings across token boundaries.

:func:`find_stop` is the stateless check (where in the whole text to truncate).
:class:`StopStringMatcher` is the streaming form: it holds back any suffix that could still grow
into a stop string, so a client never sees text that is later cut off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def find_stop(text: str, stops: Sequence[str], new_chars: int | None = None) -> tuple[str, int] | None:
    """Earliest stop string in ``text`` → ``(stop, index where it starts)``; ``None`` if none.

    ``new_chars``: only the last ``new_chars`` characters are new, so a match must end inside them.
    """
    best: tuple[str, int] | None = None
    for stop in stops:
        if not stop:
            continue
        start = 0 if new_chars is None else max(0, len(text) - new_chars - len(stop) + 1)
        i = text.find(stop, start)
        if i >= 0 and (best is None or i < best[1]):
            best = (stop, i)
    return best


def _held_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


def _pending_start(text: str, stops: Sequence[str], hit: tuple[str, int]) -> int | None:
    """Earliest index where a stop string that would beat ``hit`` may still start: ``text[j:]`` is a
    proper prefix of it (more text decides), and it starts before the hit or at the same index and comes
    earlier in ``stops`` (``find_stop``'s tie rule)."""
    stop, at = hit
    rank = stops.index(stop)
    longest = max(len(s) for s in stops)
    for j in range(max(0, len(text) - longest + 1), at + 1):
        tail = text[j:]
        if any(len(s) > len(tail) and s.startswith(tail) and (j < at or r < rank) for r, s in enumerate(stops)):
            return j
    return None


@dataclass
class StopMatch:
    """What one :meth:`StopStringMatcher.feed` produced."""

    text: str  # safe to emit now
    stopped: bool = False
    stop: str | None = None
    truncate_at: int | None = None  # index in the whole emitted-plus-held text where output ends


class StopStringMatcher:
    def __init__(self, stops: Sequence[str], include_stop: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop
        self._held = ""
        self._emitted = 0  # characters emitted so far
        self.stopped = False

    def feed(self, delta: str) -> StopMatch:
        """The text safe to emit after ``delta``.  The stop string that starts first in the whole text
        wins, however the text is split: a complete stop waits while an earlier one may still complete."""
        if self.stopped:
            return StopMatch("", True)
        buf = self._held + delta
        hit = find_stop(buf, self.stops)
        pending = None if hit is None else _pending_start(buf, self.stops, hit)
        if pending is not None:  # a stop starting earlier may still complete: it would win
            self._held = buf[pending:]
            self._emitted += pending
            return StopMatch(buf[:pending])
        if hit is not None:
            stop, i = hit
            end = i + len(stop) if self.include_stop else i
            self.stopped, self._held = True, ""
            self._emitted += end
            return StopMatch(buf[:end], True, stop, self._emitted)
        keep = _held_suffix(buf, self.stops)
        out = buf[: len(buf) - keep]
        self._held = buf[len(out):]
        self._emitted += len(out)
        return StopMatch(out)

    def flush(self) -> str:
        """At the end of a stream: the held-back text, cut at a stop string it holds (then ``stopped``)."""
        out, self._held = self._held, ""
        hit = find_stop(out, self.stops)
        if hit is not None:
            stop, i = hit
            out, self.stopped = out[: i + len(stop) if self.include_stop else i], True
        self._emitted += len(out)
        return out
