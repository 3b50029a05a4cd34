"""`top`'s gateway line: the scrape's arithmetic on a real gateway registry, the rate between scrapes, an
unreachable gateway, and the line itself."""

from __future__ import annotations

import http.server
import os
import threading

import pytest
from rich.console import Console
from snapshots import realistic

from agentserve.cli.gateway_watch import GatewayStats, GatewayWatch, parse
from agentserve.cli.top_view import render
from agentserve.gateway.metrics import Metrics


def registry_text(ok: int, bad: int, scrapes: int, streams: int) -> str:
    m = Metrics("tiny", 4096)
    for path, status, n in (("/v1/chat/completions", "200", ok), ("/v1/completions", "400", bad),
                            ("/metrics", "200", scrapes), ("/health", "200", scrapes)):
        for _ in range(n):
            m.http_requests.labels(path=path, status=status).inc()
    m.open_streams.set(streams)
    return m.render().decode()


def test_parse_counts_requests_errors_and_streams_but_not_scrapes():
    assert parse(registry_text(ok=3, bad=2, scrapes=7, streams=4)) == (5.0, 2.0, 4.0)


class _Served:
    """A one-page HTTP server whose ``/metrics`` text the test sets."""

    def __init__(self) -> None:
        self.text = ""
        served = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                body = served.text.encode()
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture
def served():
    s = _Served()
    yield s
    s.httpd.shutdown()
    s.httpd.server_close()


def test_rate_is_the_change_between_scrapes(served):
    now = [100.0]
    watch = GatewayWatch(clock=lambda: now[0])
    served.text = registry_text(ok=10, bad=0, scrapes=1, streams=2)
    first = watch.read(served.url)
    assert first.reachable and first.requests_per_s is None and first.open_streams == 2
    served.text = registry_text(ok=16, bad=0, scrapes=2, streams=0)
    now[0] += 2.0
    second = watch.read(served.url)
    assert second.requests_per_s == pytest.approx(3.0) and second.requests_total == 16


def test_an_unreachable_gateway_is_said_so_not_zero(served):
    url = served.url
    served.httpd.shutdown()
    served.httpd.server_close()
    stats = GatewayWatch().read(url)
    assert not stats.reachable
    assert "unreachable" in screen_text(GatewayStats(url, False))


def screen_text(gateway: GatewayStats) -> str:
    with open(os.devnull, "w") as sink:
        console = Console(width=120, height=40, record=True, color_system=None, file=sink)
        console.print(render(realistic(3), 120, 40, gateway))
    return console.export_text()


def test_the_line_shows_rate_streams_and_errors():
    text = screen_text(GatewayStats("http://127.0.0.1:8000", True, 40, 2.5, 3, 1))
    line = next(ln for ln in text.splitlines() if ln.startswith("HTTP"))
    assert "2.5 req/s" in line and "3 open streams" in line and "1 errors" in line
