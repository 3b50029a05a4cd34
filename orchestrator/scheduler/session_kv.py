"""Agent sessions: one conversation, its retained KV blocks, and its observed tool latencies.

A session runs at most one request at a time.  Between turns it may *hold* the block table of its
last turn (references counted in the block pool) until ``pin_deadline``:

- a turn that ends in a tool call pins the blocks for a TTL derived from this session's observed
  tool latencies (a high quantile × margin, clamped; global samples, then a default, when the
  session has too few) — Continuum's idea, so the resume prefill finds its KV resident;
- a turn that finishes keeps its blocks for a short grace until the caller says how it ended;
- anything else, an expired pin, or closing the session releases them at once; full blocks stay
  findable by prefix hash in the pool's LRU cache until evicted.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from agentserve.orchestrator.scheduler.config import KvCfg
from agentserve.orchestrator.scheduler.window import quantile

if TYPE_CHECKING:
    from agentserve.orchestrator.scheduler.request import Request

MAX_SAMPLES = 64


class SessionKV:
    __slots__ = (
        "session_id", "tokens", "num_computed", "block_table", "num_sealed", "pin_deadline",
        "active", "tool_started", "tool_latencies", "closed", "hashes", "keys",
    )  # fmt: skip

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.tokens: list[int] = []  # the conversation so far
        self.num_computed = 0  # KV valid for tokens[:num_computed] in block_table (when held)
        self.block_table: list[int] = []  # references held by the session itself
        self.num_sealed = 0
        self.pin_deadline: float | None = None
        self.active: Request | None = None
        self.tool_started: float | None = None
        self.tool_latencies: deque[float] = deque(maxlen=MAX_SAMPLES)
        self.closed = False
        self.hashes: list[int] = []  # block hashes / keys of ``tokens`` (handed on to the next turn)
        self.keys: list[tuple[int, ...]] = []

    @property
    def holds_blocks(self) -> bool:
        return bool(self.block_table)

    def observe_tool_return(self, now: float, global_samples: deque[float]) -> None:
        """The agent is back from its tool: record how long the tool took."""
        if self.tool_started is not None:
            latency = max(0.0, now - self.tool_started)
            self.tool_latencies.append(latency)
            global_samples.append(latency)
            self.tool_started = None


def tool_ttl(session: SessionKV, global_samples: deque[float], cfg: KvCfg) -> float:
    """How long to pin a session's blocks while its tool runs."""
    if len(session.tool_latencies) >= cfg.ttl_min_samples:
        base = quantile(list(session.tool_latencies), cfg.ttl_quantile) * cfg.ttl_margin
    elif len(global_samples) >= cfg.ttl_min_samples:
        base = quantile(list(global_samples), cfg.ttl_quantile) * cfg.ttl_margin
    else:
        base = cfg.ttl_default_s
    return min(cfg.ttl_cap_s, max(cfg.ttl_min_s, base))
