"""The pieces ``agentserve bench`` plugs into a sweep: how a system starts, how one run is driven, and
how the runs of one agent count become a report.

Systems: an AgentServe policy (a fresh ``agentserve up --policy P``), ``llama-server`` (llama.cpp's own
server on the same weights as GGUF, one slot per agent) or ``target`` (a server someone else runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentserve.bench import report as reporting
from agentserve.bench import servers
from agentserve.bench.metrics import SLO, RunRecord, after_warmup, aggregate, pool
from agentserve.bench.replayer import run_closed_loop
from agentserve.bench.sweep import Drive, Launch, RunSlot
from agentserve.bench.workload import Workload, WorkloadSpec

LLAMA_SERVER = "llama-server"  # the real llama.cpp server; "llamacpp" is AgentServe's emulation policy
TARGET = "target"

# tick(seconds into the run, requests finished so far)
Tick = Callable[[float, int], None]


def context_per_agent(spec: WorkloadSpec) -> int:
    """Longest conversation one agent task can reach (for llama.cpp's per-slot context), rounded up."""
    n = spec.cold_prefill.max + (spec.steps_per_task - 1) * spec.resume_prefill.max
    n += spec.steps_per_task * spec.decode.max + 64
    return -(-n // 256) * 256


def log_name(system: str, spec: WorkloadSpec) -> str:
    """The file a run's server log is kept as: one per workload, system, agent count and seed (each repeat has its
    own); :func:`~agentserve.bench.servers.keep` numbers a name already taken (an earlier bench into the folder)."""
    return f"{spec.name}-{system}-agents{spec.agents}-seed{spec.seed}.log"


def launcher(model: str, server_args: list[str], target: str | None = None, dialect: str = "openai",
             target_model: str | None = None, logs: Path | None = None) -> Launch:
    """``launch(system, spec)``: a context manager that starts ``system`` for ``spec.agents`` agents; with
    ``logs``, each server's log is kept there (:func:`log_name`)."""

    def launch(name: str, spec: WorkloadSpec) -> Any:
        keep_log = logs / log_name(name, spec) if logs is not None else None
        if name == TARGET:
            if target is None:
                raise ValueError("the target system needs --target URL")
            return servers.external(target, dialect, target_model)
        if name == LLAMA_SERVER:
            return servers.llama_server(model, spec.agents, context_per_agent(spec), keep_log=keep_log)
        return servers.agentserve(model, name, server_args, keep_log=keep_log)

    return launch


async def drive_once(target: servers.Target, workload: Workload, duration_s: float, timeout_s: float,
                     tick: Tick | None = None) -> RunRecord:
    """One closed-loop run against a started target, reporting progress every half second."""
    driver = target.make_driver()
    connect = getattr(driver, "connect", None)
    if connect is not None:
        await connect()
    count = 0

    def on_request(_: Any) -> None:
        nonlocal count
        count += 1

    async def ticker() -> None:
        t0 = time.perf_counter()
        while True:
            if tick is not None:
                tick(time.perf_counter() - t0, count)
            await asyncio.sleep(0.5)

    task = asyncio.create_task(ticker())
    try:
        return await run_closed_loop(driver, workload, duration_s, request_timeout_s=timeout_s,
                                     on_request=on_request)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if tick is not None:
            tick(duration_s, count)
        await driver.aclose()


def driver(warmup_s: float, duration_s: float, timeout_s: float, tick: Tick | None = None) -> Drive:
    """``drive(target, spec, slot)``: one run of ``warmup_s + duration_s``, the warm-up cut off."""

    def drive(target: servers.Target, spec: WorkloadSpec, slot: RunSlot) -> RunRecord:
        run = asyncio.run(drive_once(target, Workload(spec), warmup_s + duration_s, timeout_s, tick))
        return after_warmup(run, warmup_s)

    return drive


def per_repeat_ratios(runs: dict[str, list[RunRecord]], slo: SLO) -> list[dict[str, Any]]:
    """Each repeat's headline ratios (system / reference), so the spread between repeats is visible.

    Every system in ``runs`` has one run per repeat (a system that failed was dropped)."""
    keys = ("tpot_p95", "ttft_resume_p95", "throughput_tok_s")
    out = []
    for repeat in zip(*runs.values(), strict=True):
        figs = {name: aggregate(run, slo) for name, run in zip(runs, repeat, strict=True)}
        ref = figs[reporting.reference_of(figs)]
        ratios = {name: reporting.ratios(f, ref) for name, f in figs.items()}
        out.append({name: {k: r[k] for k in keys} for name, r in ratios.items()})
    return out


def point_report(runs: dict[str, list[RunRecord]], slo: SLO, meta: dict[str, Any]
                 ) -> tuple[dict[str, Any], dict[str, RunRecord]]:
    """The report of one agent count (``bench.report.build``) and each system's runs pooled."""
    pooled = {name: pool(r) for name, r in runs.items()}
    figures = {name: aggregate(run, slo) for name, run in pooled.items()}
    meta = dict(meta)
    if meta.get("repeats", 1) > 1:
        meta["per_repeat_ratios"] = per_repeat_ratios(runs, slo)
    return reporting.build(figures, meta), pooled
