"""Closed-loop replay of N agents against one :class:`~agentserve.bench.driver.Driver`.

Each agent runs its tasks back to back: send a turn, receive all its tokens, sleep for the tool,
send the next turn. No agent starts a turn after ``duration_s``; turns in flight then finish
(bounded by ``request_timeout_s``), so every recorded request is complete. A failed turn is recorded
with its error and stops that agent (a dead server ends the run quickly instead of hanging it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from agentserve.bench.driver import Driver, DriverSession
from agentserve.bench.metrics import RequestRecord, RunRecord, TaskRecord
from agentserve.bench.workload import Task, Workload

log = logging.getLogger(__name__)


async def _run_turn(session: DriverSession, rec: RequestRecord, prompt_ids, timeout_s: float) -> None:
    async with asyncio.timeout(timeout_s):
        async for ids, t in session.turn(prompt_ids, rec.max_tokens):
            rec.chunks.append((t, len(ids)))


async def _run_task(driver: Driver, task: Task, run: RunRecord, deadline: float, timeout_s: float,
                    on_request: Callable[[RequestRecord], None] | None) -> bool:
    """Play one task; returns False when the agent must stop (an error).

    The session is opened with the first turn, inside its timing: a server that needs a session (the SDK's open
    round trip) pays for it in the cold turn's TTFT, as a stateless one pays for its connection."""
    record: TaskRecord | None = None
    session: DriverSession | None = None
    try:
        for step, turn in enumerate(task.turns):
            if turn.wait_s:  # the tool runs; no need to sleep past the end of the run
                await asyncio.sleep(min(turn.wait_s, max(0.0, deadline - time.perf_counter())))
            if time.perf_counter() >= deadline:
                return True
            rec = RequestRecord(task.agent, task.index, step, turn.kind, len(turn.prompt_ids),
                                turn.decode_tokens, time.perf_counter())
            run.requests.append(rec)
            if record is None:
                record = TaskRecord(task.agent, task.index, rec.sent)
                run.tasks.append(record)
            try:
                if session is None:
                    async with asyncio.timeout(timeout_s):
                        session = await driver.open_session()
                await _run_turn(session, rec, turn.prompt_ids, timeout_s)
                if not rec.chunks:
                    raise RuntimeError("the server returned no tokens")
            except Exception as e:  # noqa: BLE001 - any failure of the system under test is a result
                rec.error = f"{type(e).__name__}: {e}"
                log.warning("agent %d task %d step %d failed: %s", task.agent, task.index, step, rec.error)
                return False
            if on_request is not None:
                on_request(rec)
        if record is not None:
            record.end = rec.chunks[-1][0]
        return True
    finally:
        if session is not None:
            await session.close()


async def run_closed_loop(
    driver: Driver,
    workload: Workload,
    duration_s: float,
    *,
    request_timeout_s: float = 300.0,
    on_request: Callable[[RequestRecord], None] | None = None,
) -> RunRecord:
    """Drive ``workload.spec.agents`` agents for ``duration_s`` seconds; returns every timeline."""
    start = time.perf_counter()
    deadline = start + duration_s
    run = RunRecord(start=start, end=start, window_s=duration_s)

    async def agent(i: int) -> None:
        await asyncio.sleep(workload.start_offset(i))
        index = 0
        while time.perf_counter() < deadline:
            ok = await _run_task(driver, workload.task(i, index), run, deadline, request_timeout_s,
                                 on_request)
            if not ok:
                return
            index += 1

    await asyncio.gather(*(agent(i) for i in range(workload.spec.agents)))
    run.end = max(time.perf_counter(), deadline)  # rates divide by window_s: a run its agents left early
    return run  # (errors) still spans its window, and one whose last turns drain past it no more than that
