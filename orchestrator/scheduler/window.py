"""Sliding time windows of latency samples (TPOT, TTFT) for the controller and for stats."""

from __future__ import annotations

from collections import deque


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.5) - 1))]


class Window:
    """Samples of the last ``span_s`` seconds (at most ``maxlen``), with quantiles on demand."""

    def __init__(self, span_s: float, maxlen: int = 8192) -> None:
        self.span_s = span_s
        self._items: deque[tuple[float, float]] = deque(maxlen=maxlen)
        self.total = 0

    def add(self, t: float, value: float) -> None:
        self._items.append((t, value))
        self.total += 1

    def expire(self, now: float) -> None:
        items, horizon = self._items, now - self.span_s
        while items and items[0][0] < horizon:
            items.popleft()

    def clear(self) -> None:
        self._items.clear()

    def values(self, now: float) -> list[float]:
        self.expire(now)
        return [v for _, v in self._items]

    def count(self, now: float) -> int:
        self.expire(now)
        return len(self._items)

    def quantile(self, q: float, now: float) -> float | None:
        values = self.values(now)
        return quantile(values, q) if values else None

    def summary(self, now: float) -> dict[str, float | int | None]:
        values = self.values(now)
        if not values:
            return {"n": 0, "mean": None, "p50": None, "p95": None, "p99": None}
        return {
            "n": len(values),
            "mean": sum(values) / len(values),
            "p50": quantile(values, 0.5),
            "p95": quantile(values, 0.95),
            "p99": quantile(values, 0.99),
        }
