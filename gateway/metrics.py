"""``GET /metrics``: Prometheus text with vLLM's metric names, types, labels and buckets.

Every vLLM metric is emitted under ``agentserve:`` and, with ``--metrics-compat vllm``, also under
``vllm:`` (so an existing vLLM Grafana dashboard works unchanged).  Request metrics are observed by
the gateway as each request's turns end; the gauges are read from the orchestrator's stats snapshot
at scrape time.  AgentServe's own metrics (``agentserve:`` only): TTFT and prefix-cache tokens by
class (cold: a new conversation, resume: a continued one), the controller's ``B_prefill`` and
``R_min``, the rung in use, lane utilisation, pinned KV blocks, and the gateway's own counters.

``request_queue_time_seconds`` is observed only when the orchestrator reports a queue time (it does
not split queueing from prefill yet); ``request_prefill_time_seconds`` is then arrival → first token.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from agentserve.protocol.client_messages import TurnDone
from agentserve.protocol.stats import SessionState, Snapshot

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]


def buckets_1_2_5(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's token-count buckets)."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(float(m * scale))
        scale *= 10


class _Family:
    """One metric under each prefix; calls go to all of them."""

    def __init__(self, metrics: list[Any]) -> None:
        self.metrics = metrics

    def labels(self, **labels: str) -> _Family:
        return _Family([m.labels(**labels) for m in self.metrics])

    def observe(self, value: float) -> None:
        for m in self.metrics:
            m.observe(value)

    def inc(self, value: float = 1.0) -> None:
        for m in self.metrics:
            m.inc(value)

    def set(self, value: float) -> None:
        for m in self.metrics:
            m.set(value)


class Metrics:
    def __init__(self, model_name: str, max_model_len: int, compat: Iterable[str] = ()) -> None:
        self.registry = CollectorRegistry()
        self.model = model_name
        self.prefixes = ["agentserve", *(c for c in compat if c == "vllm")]
        tokens = buckets_1_2_5(max(max_model_len, 1))
        g, h, c = self._gauge, self._histogram, self._counter
        self.running = g("num_requests_running", "Requests decoding (sessions with a turn past its first token).")
        self.waiting = g("num_requests_waiting", "Requests waiting for or in their prefill.")
        self.kv_usage = g("kv_cache_usage_perc", "KV cache usage (1 = every block in use).")
        self.ttft = h("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = h("inter_token_latency_seconds", "Time between consecutive tokens.", ITL_BUCKETS)
        self.e2e = h("e2e_request_latency_seconds", "End-to-end request latency.", REQUEST_BUCKETS)
        self.queue = h("request_queue_time_seconds", "Time waiting before the first scheduling.", REQUEST_BUCKETS)
        self.prefill = h("request_prefill_time_seconds", "Time in prefill (to the first token).", REQUEST_BUCKETS)
        self.decode = h("request_decode_time_seconds", "Time in decode (first to last token).", REQUEST_BUCKETS)
        self.prompt_hist = h("request_prompt_tokens", "Prompt tokens per request.", tokens)
        self.gen_hist = h("request_generation_tokens", "Generated tokens per request.", tokens)
        self.prompt_total = c("prompt_tokens", "Prompt tokens processed (cached ones included).")
        self.gen_total = c("generation_tokens", "Tokens generated.")
        self.success = c("request_success", "Finished requests by finish reason.", ["finished_reason"])
        self.prefix_queries = c("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = c("prefix_cache_hits", "Prompt tokens served from the KV cache.")
        self.preemptions = c("num_preemptions", "Requests preempted (their KV freed, recomputed later).")
        self._seen_preemptions = 0  # the orchestrator's count at the last scrape (it restarts from 0 with a scheduler)
        self._own()

    def _own(self) -> None:
        own = dict(prefixes=["agentserve"])
        g, h, c = self._gauge, self._histogram, self._counter
        self.ttft_class = h("time_to_first_token_by_class_seconds",
                            "TTFT by request class: cold (a new conversation) or resume (a continued one).",
                            TTFT_BUCKETS, ["class"], **own)
        self.queries_class = c("prefix_cache_queries_by_class", "Prompt tokens by request class (cold | resume).",
                               ["class"], **own)
        self.hits_class = c("prefix_cache_hits_by_class", "Prompt tokens served from the KV cache, by request class.",
                            ["class"], **own)
        self.b_prefill = g("controller_b_prefill_tokens", "The controller's resume-prefill budget B_prefill.", **own)
        self.r_min = g("controller_r_min_rung", "The controller's decode reserve R_min (a rung index).", **own)
        self.rung = g("partition_rung", "The partition rung the decode lane runs on.", **own)
        self.lane_util = g("lane_utilisation", "Busy share of wall time over the last 10 s.", ["lane"], **own)
        self.pinned = g("kv_pinned_blocks", "KV blocks held for sessions that are in a tool call.", **own)
        self.kv_used = g("kv_used_blocks", "KV blocks in use.", **own)
        self.http_requests = c("http_requests", "HTTP requests answered, by path and status.", ["path", "status"],
                               **own)
        self.open_streams = g("http_open_streams", "Streamed responses in flight.", **own)
        self.conversations = g("conversation_map_sessions", "Idle sessions filed for continuation.", **own)
        self.continued = c("conversation_continuations", "Requests that continued a filed session.", **own)

    # ---- construction ------------------------------------------------------------------------
    def _make(self, cls: type, name: str, doc: str, labels: list[str] | None, prefixes: list[str] | None,
              **kw: Any) -> _Family:
        names = ["model_name", *(labels or [])]
        made = [cls(f"{p}:{name}", doc, names, registry=self.registry, **kw) for p in prefixes or self.prefixes]
        return _Family(made)

    def _gauge(self, name: str, doc: str, labels: list[str] | None = None, prefixes: list[str] | None = None):
        return _ModelBound(self._make(Gauge, name, doc, labels, prefixes), self.model, bool(labels))

    def _counter(self, name: str, doc: str, labels: list[str] | None = None, prefixes: list[str] | None = None):
        return _ModelBound(self._make(Counter, name, doc, labels, prefixes), self.model, bool(labels))

    def _histogram(self, name: str, doc: str, buckets: list[float], labels: list[str] | None = None,
                   prefixes: list[str] | None = None):
        fam = self._make(Histogram, name, doc, labels, prefixes, buckets=buckets)
        return _ModelBound(fam, self.model, bool(labels))

    # ---- observations ------------------------------------------------------------------------
    def on_turn(self, done: TurnDone | Any, ttft_s: float | None, gaps_s: list[float], e2e_s: float,
                resumed: bool, finish: str) -> None:
        """One finished choice: ``done`` is its ``Done`` event (usage, server timings)."""
        usage, timings = done.usage, done.timings
        by_class = {"class": "resume" if resumed else "cold"}
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            self.ttft_class.labels(**by_class).observe(ttft_s)
        self.queries_class.labels(**by_class).inc(usage.prompt_tokens)
        self.hits_class.labels(**by_class).inc(usage.cached_tokens)
        for gap in gaps_s:
            self.itl.observe(gap)
        self.e2e.observe(e2e_s)
        if timings.queue_ms > 0:
            self.queue.observe(timings.queue_ms / 1e3)
        self.prefill.observe(max(0.0, timings.ttft_ms - timings.queue_ms) / 1e3)
        self.decode.observe(max(0.0, timings.e2e_ms - timings.ttft_ms) / 1e3)
        self.prompt_hist.observe(usage.prompt_tokens)
        self.gen_hist.observe(usage.completion_tokens)
        self.prompt_total.inc(usage.prompt_tokens)
        self.gen_total.inc(usage.completion_tokens)
        self.prefix_queries.inc(usage.prompt_tokens)
        self.prefix_hits.inc(usage.cached_tokens)
        self.success.labels(finished_reason=finish).inc()
        if resumed:
            self.continued.inc()

    def on_snapshot(self, snap: Snapshot, filed_sessions: int) -> None:
        states = [row.state for row in snap.sessions]
        self.running.set(sum(s == SessionState.DECODING for s in states))
        self.waiting.set(sum(s in (SessionState.PREFILLING, SessionState.QUEUED) for s in states))
        kv = snap.kv
        self.kv_usage.set(kv.used_blocks / kv.total_blocks if kv.total_blocks else 0.0)
        self.kv_used.set(kv.used_blocks)
        self.pinned.set(kv.pinned_blocks)
        since = kv.preemptions - self._seen_preemptions if kv.preemptions >= self._seen_preemptions else kv.preemptions
        self.preemptions.inc(since)
        self._seen_preemptions = kv.preemptions
        self.b_prefill.set(snap.control.b_prefill)
        self.r_min.set(snap.control.r_min)
        self.rung.set(snap.partition.rung)
        for lane in snap.lanes:
            self.lane_util.labels(lane=lane.name).set(lane.utilisation)
        self.conversations.set(filed_sessions)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ModelBound:
    """A family with ``model_name`` filled in."""

    def __init__(self, family: _Family, model: str, has_labels: bool) -> None:
        self._family = family
        self._model = model
        self._bound = None if has_labels else family.labels(model_name=model)

    def labels(self, **labels: str) -> _Family:
        return self._family.labels(model_name=self._model, **labels)

    def __getattr__(self, name: str) -> Any:
        assert self._bound is not None, "this metric has labels: call .labels(...) first"
        return getattr(self._bound, name)
