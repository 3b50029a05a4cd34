"""The SDK driver against the client area's in-test server (real ingress + client, echo engine)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from bench_fakes import tiny_workload

from agentserve.bench.replayer import run_closed_loop
from agentserve.bench.sdk_driver import SDKDriver

sys.path.insert(0, str(Path(__file__).parents[1] / "client"))
from agent_fake_server import EchoServer  # noqa: E402


def test_sdk_driver_replays_raw_token_turns(tmp_path):
    w = tiny_workload(agents=2, steps=3, tool_s=0.01)

    async def main(endpoint):
        driver = SDKDriver(endpoint)
        await driver.connect()
        try:
            return await run_closed_loop(driver, w, duration_s=0.5, request_timeout_s=10)
        finally:
            await driver.aclose()

    with EchoServer(f"ipc://{tmp_path}/as.sock") as server:
        run = asyncio.run(main(server.endpoint))
        turns = list(server.turn_requests)
    assert run.requests and all(r.error is None for r in run.requests)
    assert all(r.n_tokens == r.max_tokens for r in run.requests)
    assert len(turns) == len(run.requests)
    # raw-token mode: each turn carries exactly the tokens the script appends, ignore_eos, max_tokens
    by_order = sorted(run.requests, key=lambda r: r.sent)
    scripted = {tuple(w.task(r.agent, r.task).turns[r.step].prompt_ids) for r in by_order}
    assert {tuple(t.token_ids) for t in turns} <= scripted
    assert all(t.ignore_eos and not t.messages for t in turns)
    assert sorted(t.max_tokens for t in turns) == sorted(r.max_tokens for r in run.requests)
