"""When a turn's tokens came, for the request metrics of ``/v1/chat/completions`` and ``/v1/completions`` alike:
arrival to first token on the gateway's clock (what the HTTP client waits), the gaps between tokens on the
orchestrator's (what decoding took, without the gateway's own scheduling noise)."""

from __future__ import annotations

import time
from typing import Any

from agentserve.client import Done, TokenIds
from agentserve.gateway.metrics import Metrics


class TurnTimer:
    def __init__(self) -> None:
        self.t_arrival = time.monotonic()
        self.t_first: float | None = None
        self.gaps: list[float] = []  # seconds between consecutive tokens
        self._t_server: float | None = None

    def on_tokens(self, event: TokenIds) -> None:
        self.t_first = self.t_first or time.monotonic()
        if self._t_server is not None and event.token_ids:
            self.gaps.append(event.t_server - self._t_server)
        self._t_server = event.t_server if event.token_ids else self._t_server

    def observe(self, metrics: Metrics | None, done: Done | None, resumed: bool, reason: str) -> None:
        """A finished turn (``done``, its ``finish_reason`` as the API names it) into the request metrics."""
        if metrics is None or done is None:
            return
        ttft = self.t_first - self.t_arrival if self.t_first is not None else None
        metrics.on_turn(done, ttft, self.gaps, time.monotonic() - self.t_arrival, resumed, reason)


def count_abandoned(metrics: Metrics | None, session: Any) -> None:
    """A turn given up with its session still held (the client went away, the turn failed): an ``abort``."""
    if metrics is not None and session is not None:
        metrics.success.labels(finished_reason="abort").inc()
