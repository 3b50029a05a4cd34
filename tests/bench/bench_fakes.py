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
        for k in range(max_tokens):
            await asyncio.sleep(self.driver.token_s)
            self.history.append(1000 + k)
            yield [1000 + k], time.perf_counter()

    async def close(self):
        self.driver.closed += 1


class FakeDriver:
    name = "fake"

    def __init__(self, token_s: float = 0.001, fail_after: int | None = None) -> None:
        self.token_s = token_s
        self.fail_after = fail_after
        self.turns = 0
        self.opened = 0
        self.closed = 0

    async def open_session(self):
        self.opened += 1
        return FakeSession(self)

    async def aclose(self):
        return None


class FakeCompletionServer:
    """Streams ``n`` tokens (ids 100, 101, ...) in chunked SSE; remembers every request body.

    ``llamacpp`` replies in llama.cpp's native shape; ``hold_back`` makes it skip the event of token
    1 (as llama.cpp does inside a UTF-8 character), so token 2's event then reports both.
    """

    def __init__(self, hold_back: bool = False, status: int = 200) -> None:
        self.bodies: list[dict] = []
        self.paths: list[str] = []
        self.hold_back = hold_back
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
        if path == "/completion":
            n = body["n_predict"]
            for k in range(n):
                if self.hold_back and k == 1:
                    continue
                yield {"content": "x", "tokens": [100 + k], "stop": False, "tokens_predicted": k + 1}
            yield {"content": "", "tokens": [], "stop": True, "tokens_predicted": n}
        else:
            for k in range(body["max_tokens"]):
                yield {"choices": [{"text": "x", "index": 0, "token_ids": [100 + k]}]}


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
