"""What `agentserve top` shows of the HTTP gateway: requests per second and open streams, scraped from
its ``/metrics`` (the address comes from the snapshot; the gateway needs no key for ``/metrics``).

A scrape that fails (the gateway restarting, a slow answer) is shown as unreachable, never as zeros.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

REQUESTS = "agentserve:http_requests"
OPEN_STREAMS = "agentserve:http_open_streams"
TIMEOUT_S = 0.5
UNCOUNTED = ("/metrics", "/health")


@dataclass(frozen=True)
class GatewayStats:
    url: str
    reachable: bool
    requests_total: float = 0.0
    requests_per_s: float | None = None  # None until two scrapes are known
    open_streams: float = 0.0
    errors_total: float = 0.0  # requests answered 4xx / 5xx

    def as_json(self) -> dict[str, object]:
        return {"url": self.url, "reachable": self.reachable, "requests_total": self.requests_total,
                "requests_per_s": self.requests_per_s, "open_streams": self.open_streams,
                "errors_total": self.errors_total}


def parse(text: str) -> tuple[float, float, float]:
    """(requests answered, of those 4xx/5xx, open streams) from a Prometheus text exposition; scrapes
    (``/metrics``) and probes (``/health``) are not requests."""
    total = errors = streams = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == REQUESTS + "_total" and sample.labels.get("path") not in UNCOUNTED:
                total += sample.value
                errors += sample.value if sample.labels.get("status", "")[:1] in ("4", "5") else 0.0
            elif sample.name == OPEN_STREAMS:
                streams += sample.value
    return total, errors, streams


class GatewayWatch:
    """Scrapes one gateway; the request rate is the counter's change since the previous scrape."""

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._last: tuple[str, float, float] | None = None  # url, time, requests_total

    def read(self, url: str) -> GatewayStats:
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=TIMEOUT_S) as r:  # noqa: S310
                total, errors, streams = parse(r.read().decode("utf-8", "replace"))
        except (OSError, ValueError, urllib.error.URLError):
            self._last = None
            return GatewayStats(url, reachable=False)
        now, rate = self._clock(), None
        if self._last is not None and self._last[0] == url and now > self._last[1] and total >= self._last[2]:
            rate = (total - self._last[2]) / (now - self._last[1])
        self._last = (url, now, total)
        return GatewayStats(url, True, total, rate, streams, errors)
