"""Fakes for the bench tests: an in-process driver and a tiny local OpenAI/llama.cpp-style SSE server."""

from __future__ import annotations

import asyncio
import json
import time

from agentserve.bench.workload import Span, ToolLatency, Workload, WorkloadSpec


def tiny_workload(agents: int = 2, steps: int = 3, tool_s: float = 0.01) -> Workload:
    return Workload(WorkloadSpec(
        name="tiny", agents=agents, steps_per_task=steps, seed=3, shared_prefix_tokens=6,
        vocab_low=10, vocab_high=50, cold_prefill=Span(10, 14, 12), resume_prefill=Span(2, 5, 3),
        decode=Span(3, 5, 4), tool_latency=ToolLatency(tool_s, 0.1),
    ))


class FakeSession:
    def __init__(self, driver: FakeDriver) -> None:
        self.driver = driver
        self.history: list[int] = []

    async def turn(self, prompt_ids, max_tokens):
        self.history.extend(prompt_ids)
        if self.driver.fail_after is not None and self.driver.turns >= self.driver.fail_after:
            raise ConnectionError("server gone")
        self.driver.turns += 1
        for k in range(max(1, max_tokens - self.driver.short_by)):
            await asyncio.sleep(self.driver.token_s)
            self.history.append(1000 + k)
            yield [1000 + k], time.perf_counter()

    async def close(self):
        self.driver.closed += 1


class FakeDriver:
    name = "fake"

    def __init__(self, token_s: float = 0.001, fail_after: int | None = None, short_by: int = 0,
                 open_s: float = 0.0, open_fails: bool = False) -> None:
        self.token_s = token_s
        self.open_s = open_s  # an open's round trip
        self.open_fails = open_fails
        self.fail_after = fail_after
        self.short_by = short_by  # tokens left out of each reply (a server that ignores ignore_eos)
        self.turns = 0
        self.opened = 0
        self.closed = 0

    async def open_session(self):
        await asyncio.sleep(self.open_s)
        if self.open_fails:
            raise ConnectionError("open refused")
        self.opened += 1
        return FakeSession(self)

    async def aclose(self):
        return None


class FakeCompletionServer:
    """Streams ``n`` tokens (ids 100, 101, ...) in chunked SSE; remembers every request body.

    ``llamacpp`` replies in llama.cpp's native shape; ``hold_back`` makes it skip the event of token
    1 (as llama.cpp does inside a UTF-8 character), so token 2's event then reports both.  On
    ``/v1/completions``: ``pairs`` sends two tokens' text per chunk and no ids (a server without
    ``return_token_ids``), with the usage chunk when asked; ``cut_after`` ends the stream after that many
    tokens, before any ``finish_reason`` / ``stop`` (a server that died mid-reply).
    """

    def __init__(self, hold_back: bool = False, status: int = 200, pairs: bool = False,
                 cut_after: int | None = None, usage_on_last: bool = False) -> None:
        self.bodies: list[dict] = []
        self.paths: list[str] = []
        self.hold_back = hold_back
        self.pairs = pairs
        self.cut_after = cut_after
        self.usage_on_last = usage_on_last  # usage in the last choice chunk (llama-server), not a chunk of its own
        self.status = status
        self.json_replies: dict[str, dict] = {"/health": {"status": "ok"}}  # paths answered with fixed JSON
        self.server: asyncio.base_events.Server | None = None

    @property
    def url(self) -> str:
        host, port = self.server.sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc):
        self.server.close()
        await self.server.wait_closed()

    async def _handle(self, reader, writer):
        request_line = (await reader.readline()).decode()
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        body = json.loads(await reader.readexactly(length)) if length else {}
        path = request_line.split(" ")[1]
        self.paths.append(path)
        self.bodies.append(body)
        if path in self.json_replies:
            data = json.dumps(self.json_replies[path], separators=(",", ":")).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
        elif self.status != 200:
            msg = b'{"error":"bad request"}'
            writer.write(b"HTTP/1.1 %d Bad\r\nContent-Length: %d\r\n\r\n%s" % (self.status, len(msg), msg))
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
            for event in self._events(path, body):
                data = b"data: " + json.dumps(event).encode() + b"\r\n\r\n"
                # split every event over two chunks to exercise reassembly
                for part in (data[:7], data[7:]):
                    writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                await writer.drain()
                await asyncio.sleep(0.002)
            if path == "/v1/completions":
                done = b"data: [DONE]\n\n"
                writer.write(b"%x\r\n%s\r\n" % (len(done), done))
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    def _events(self, path, body):
        n = body["n_predict"] if path == "/completion" else body["max_tokens"]
        cut = n if self.cut_after is None else self.cut_after
        if path == "/completion":
            for k in range(cut):
                if self.hold_back and k == 1:
                    continue
                yield {"content": "x", "tokens": [100 + k], "stop": False, "tokens_predicted": k + 1}
            if cut == n:
                yield {"content": "", "tokens": [], "stop": True, "tokens_predicted": n}
            return
        step = 2 if self.pairs else 1
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
        wants_usage = (body.get("stream_options") or {}).get("include_usage")
        for k in range(0, cut, step):
            last = k + step >= n
            choice = {"text": "x" * min(step, n - k), "index": 0, "finish_reason": "length" if last else None}
            event = {"choices": [choice if self.pairs else choice | {"token_ids": [100 + k]}]}
            yield event | ({"usage": usage} if last and wants_usage and self.usage_on_last else {})
        if cut == n and wants_usage and not self.usage_on_last:
            yield {"choices": [], "usage": usage}


class ThreadedServer:
    """A :class:`FakeCompletionServer` on its own event loop thread, for code that runs ``asyncio.run``."""

    def __init__(self, **kwargs) -> None:
        self.fake = FakeCompletionServer(**kwargs)
        self.loop = asyncio.new_event_loop()

    def __enter__(self) -> FakeCompletionServer:
        import threading

        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.fake.__aenter__(), self.loop).result(5)
        return self.fake

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.fake.__aexit__(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


# ---- made-up runs, reports and sweeps (for the sweep, plot and paper-report tests) ----

def fake_request(sent: float, ttft: float, tpot: float, n: int = 4, kind: str = "resume", agent: int = 0):
    """A finished request: first token ``ttft`` after ``sent``, then ``n - 1`` tokens ``tpot`` apart."""
    from agentserve.bench.metrics import RequestRecord

    chunks = [(sent + ttft + k * tpot, 1) for k in range(n)]
    return RequestRecord(agent, 0, 0 if kind == "cold" else 1, kind, 30, n, sent, chunks)


def fake_run(ttfts: list[float], tpots: list[float], elapsed: float = 10.0, start: float = 0.0,
             cold_every: int = 4):
    """A run of one request per (TTFT, TPOT) pair, sent 0.1 s apart; every ``cold_every``-th is cold."""
    from agentserve.bench.metrics import RunRecord

    reqs = [fake_request(start + 0.1 * i, a, b, kind="cold" if i % cold_every == 0 else "resume")
            for i, (a, b) in enumerate(zip(ttfts, tpots, strict=True))]
    return RunRecord(start, start + elapsed, reqs)


def fake_figures(slo_att: float = 0.9, ttft_p95: float = 300.0, tpot_p95: float = 30.0, tput: float = 70.0,
                 **extra: float) -> dict:
    """Per-system figures in ``bench.metrics.aggregate``'s shape, with chosen values (ms, tok/s)."""
    return {
        "requests": 100, "errors": 0,
        "ttft": {"p50": ttft_p95 / 2, "p95": ttft_p95, "p99": ttft_p95 * 1.2, "std": extra.get("ttft_std", 50.0)},
        "ttft_cold": {"p95": extra.get("ttft_cold_p95", ttft_p95 * 3)},
        "ttft_resume": {"p95": extra.get("ttft_resume_p95", ttft_p95)},
        "tpot": {"p50": tpot_p95 / 2, "p95": tpot_p95, "p99": tpot_p95 * 1.3, "std": extra.get("tpot_std", 5.0)},
        "throughput_tok_s": tput, "slo_attainment": slo_att,
        "ttft_slo_attainment": extra.get("ttft_att", min(1.0, slo_att + 0.05)),
        "tpot_slo_attainment": extra.get("tpot_att", min(1.0, slo_att + 0.02)), "goodput": extra.get("goodput", 1.0),
    }


FAKE_MACHINE = {"cpu_model": "Fake CPU 9000", "cpu_flags": ["avx2", "avx512f"], "cpus": 2, "machine": "x86_64",
                "gpus": [], "loadavg_1_5_15": [1.0, 1.1, 1.2]}


def fake_point(agents: int, systems: dict[str, dict], workload: str = "react") -> dict:
    """A single-count report (``bench.report.build``'s shape) with a fixed, made-up machine and date."""
    from agentserve.bench import report

    meta = {"workload": workload, "agents": agents, "duration_s": 20.0, "warmup_s": 0.0, "model": "tiny",
            "repeats": 1, "slo": {"ttft_ms": 2000.0, "tpot_ms": 100.0}, "failed": [],
            "command": "agentserve bench --agents 1,2", **FAKE_MACHINE}
    rep = report.build(systems, meta)
    rep["meta"]["date"] = "2026-12-01T10:00:00Z"
    return rep


def fake_sweep(by_count: dict[int, dict[str, dict]], workload: str = "react", failed: dict | None = None) -> dict:
    """A sweep JSON from ``{agents: {system: figures}}``."""
    from agentserve.bench import sweep_report

    points = [fake_point(n, systems, workload) for n, systems in by_count.items()]
    return sweep_report.build(points, {"failed": failed or {}, "finished": "2026-12-01T11:00:00Z"})


class FakeLaunches:
    """``launch(system, spec)`` for ``sweep.execute``: records every start and stop, yields the system name.

    ``fail`` maps (system, agents) to the number of launches that fail at that count (``None``: all)."""

    def __init__(self, fail: dict | None = None) -> None:
        self.log: list[tuple[str, str, int, int]] = []  # (event, system, agents, seed)
        self.fail = dict(fail or {})
        self.running = 0

    def __call__(self, system, spec):
        import contextlib

        @contextlib.contextmanager
        def server():
            key = (system, spec.agents)
            if key in self.fail and self.fail[key] != 0:
                self.fail[key] = None if self.fail[key] is None else self.fail[key] - 1
                self.log.append(("refused", system, spec.agents, spec.seed))
                raise RuntimeError(f"{system} would not start")
            assert self.running == 0, "two servers at once"
            self.running += 1
            self.log.append(("start", system, spec.agents, spec.seed))
            try:
                yield system
            finally:
                self.running -= 1
                self.log.append(("stop", system, spec.agents, spec.seed))

        return server()
