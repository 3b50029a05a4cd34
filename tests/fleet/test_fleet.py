"""``agentserve fleet up`` with two ``tiny`` workers behind sglang-router on loopback: an agent keeps its
worker (every resume continues the session that worker holds) while agents spread over both; a worker
SIGKILLed mid-run costs its agents a re-prefill on the other, no turn hangs, every turn ends with an
answer or a clear error, and the router takes the worker back when it is restarted on the same port; the
fleet stops cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agentserve.bench.openai_driver import OpenAIDriver
from agentserve.cli.fleet import parse_ready_line
from agentserve.cli.fleet_members import worker_command
from agentserve.protocol.endpoints import default_endpoint

pytest.importorskip("sglang_router")
pytestmark = pytest.mark.slow

SHARED = [random.Random(7).randrange(10, 250) for _ in range(300)]  # the system prompt every agent sends
WORKER_ARGS = ["--dtype", "float32", "--num-blocks", "1024", "--max-model-len", "4096"]


class Fleet:
    def __init__(self, tmp) -> None:
        self.name = f"ft{uuid.uuid4().hex[:6]}"
        self.log = open(tmp / "fleet.err", "w+")  # noqa: SIM115 - closed in stop()
        cmd = ["agentserve", "fleet", "up", "--workers", "2", "--model", "tiny", "--name", self.name,
               "--port", "0", "--worker-base-port", "0", "--metrics-port", "0", "--log-dir", str(tmp / "logs"),
               *[f"--server-arg={a}" for a in WORKER_ARGS]]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.proc.stdout.readline()
        assert line.startswith("AgentServe fleet ready"), f"fleet did not start: {line!r}\n{self.logs()}"
        ready = parse_ready_line(line)
        self.router, self.workers, self.logs_dir = ready["router"], ready["workers"], tmp / "logs"

    def logs(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def worker_health(self) -> dict[str, bool]:
        answer = httpx.get(self.router + "/workers", timeout=5).json()
        return {w["url"]: w["is_healthy"] for w in answer["workers"]}

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(60)
        finally:
            self.log.close()
        return code


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("fleet"))
    yield f
    logs = f.logs()
    assert f.stop() == 0, logs
    assert not [n for n in os.listdir("/dev/shm") if f.name in n], "shared memory left behind"
    left = subprocess.run(["pgrep", "-f", f"--run {f.name}-"], capture_output=True, text=True).stdout.strip()
    assert not left, f"worker processes left behind: {left}"
    assert not [r for r in (default_endpoint(f"{f.name}-w{i}") for i in range(2))
                if os.path.exists(r.removeprefix("ipc://"))], "ipc sockets left behind"


def counters(url: str) -> dict[str, float]:
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=5).text)}

    def total(name: str, **labels: str) -> float:
        family = families.get(name)
        return sum(s.value for s in family.samples if s.name.endswith(("_total", "_count"))
                   and labels.items() <= s.labels.items()) if family else 0.0

    return {"requests": total("agentserve:request_success"),
            "continued": total("agentserve:conversation_continuations"),
            "cold": total("agentserve:time_to_first_token_by_class_seconds", **{"class": "cold"})}


@dataclass
class TurnResult:
    agent: int
    turn: int
    started: float
    ended: float
    tokens: int
    error: str | None = None


async def agent(router: str, index: int, turns: int, results: list[TurnResult], pause_s: float = 0.3,
                until: float | None = None) -> None:
    """One agent: a cold prompt (the shared system prompt, then its own task), then short tool results."""
    rng = random.Random(index)
    session = await OpenAIDriver(router, dialect="chat", model="tiny").open_session()
    for turn in range(turns):
        if until is not None and time.monotonic() > until:
            break
        prompt = SHARED + [rng.randrange(10, 250) for _ in range(400)] if turn == 0 else \
            [rng.randrange(10, 250) for _ in range(rng.randint(10, 30))]
        started = time.monotonic()
        tokens, error = 0, None
        try:
            async with asyncio.timeout(60):
                async for ids, _ in session.turn(prompt, 8):
                    tokens += len(ids)
        except Exception as e:  # noqa: BLE001 - every failure is a result: it must be a clear one
            error = f"{type(e).__name__}: {e}"
        results.append(TurnResult(index, turn, started, time.monotonic(), tokens, error))
        await asyncio.sleep(pause_s)


def run_agents(router: str, n: int, turns: int, until: float | None = None) -> list[TurnResult]:
    results: list[TurnResult] = []

    async def main():
        await asyncio.gather(*(agent(router, i, turns, results, until=until) for i in range(n)))

    asyncio.run(main())
    return results


def test_an_agent_keeps_its_worker_and_agents_spread(fleet) -> None:
    before = {w: counters(w) for w in fleet.workers}
    results = run_agents(fleet.router, n=6, turns=5)
    after = {w: counters(w) for w in fleet.workers}
    assert all(r.error is None and r.tokens == 8 for r in results), [r for r in results if r.error]
    resumes = sum(r.turn > 0 for r in results)
    delta = {w: {k: after[w][k] - before[w][k] for k in after[w]} for w in fleet.workers}
    continued = sum(d["continued"] for d in delta.values())
    assert continued >= 0.9 * resumes, (continued, resumes, delta)  # the resumes found their sessions
    assert all(d["requests"] >= 5 for d in delta.values()), delta  # both workers hold agents


def test_a_killed_worker_costs_its_agents_a_re_prefill_and_comes_back(fleet) -> None:
    w0, w1 = fleet.workers
    run0 = f"{fleet.name}-w0"
    pid = int(subprocess.run(["pgrep", "-f", f"agentserve up .*--run {run0} "], capture_output=True,
                             text=True).stdout.split()[0])
    w1_before = counters(w1)
    results: list[TurnResult] = []
    killed_at: list[float] = []

    async def main():
        async def kill_soon():
            await asyncio.sleep(3.0)
            os.kill(pid, signal.SIGKILL)
            killed_at.append(time.monotonic())

        deadline = time.monotonic() + 12.0
        await asyncio.gather(kill_soon(), *(agent(fleet.router, 10 + i, 40, results, until=deadline)
                                            for i in range(6)))

    asyncio.run(main())
    kill = killed_at[0]
    assert all(r.ended - r.started < 30 for r in results), "a turn hung"
    errors = [r for r in results if r.error]
    assert all("HTTP" in r.error or "finish_reason" in r.error for r in errors), errors  # clear errors only
    assert len(errors) <= 6, errors  # at most the turns that were running on the killed worker
    after_kill = [r for r in results if r.started > kill + 0.5 and r.error is None]
    assert {r.agent for r in after_kill} == {10 + i for i in range(6)}, "an agent stopped being served"
    assert counters(w1)["cold"] - w1_before["cold"] >= 1  # the moved conversations were prefilled anew

    deadline = time.monotonic() + 15
    while fleet.worker_health().get(w0, True) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert fleet.worker_health() == {w0: False, w1: True}

    host, port = w0.removeprefix("http://").rsplit(":", 1)
    restarted = subprocess.Popen(worker_command("tiny", run0, host, int(port), default_endpoint(run0), WORKER_ARGS),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while not fleet.worker_health().get(w0) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert fleet.worker_health() == {w0: True, w1: True}
        fresh = run_agents(fleet.router, n=4, turns=1)
        assert all(r.error is None for r in fresh), fresh
        assert counters(w0)["requests"] >= 1  # new conversations reach the restarted worker
    finally:
        restarted.send_signal(signal.SIGTERM)
        assert restarted.wait(30) == 0
