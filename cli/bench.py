"""``agentserve bench``: the same closed-loop agent workload against each policy / system, side by side."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import time
from collections.abc import Callable
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from agentserve.bench import report as reporting
from agentserve.bench import servers
from agentserve.bench.metrics import SLO, RunRecord, after_warmup, aggregate, pool
from agentserve.bench.replayer import run_closed_loop
from agentserve.bench.workload import Workload, WorkloadSpec, load_spec

LLAMA_SERVER = "llama-server"  # the real llama.cpp server; "llamacpp" is AgentServe's emulation policy


def context_per_agent(spec: WorkloadSpec) -> int:
    """Longest conversation one agent task can reach (for llama.cpp's per-slot context), rounded up."""
    n = spec.cold_prefill.max + (spec.steps_per_task - 1) * spec.resume_prefill.max
    n += spec.steps_per_task * spec.decode.max + 64
    return -(-n // 256) * 256


def launchers(policies: list[str], model: str, spec: WorkloadSpec, server_args: list[str]
              ) -> list[tuple[str, Callable[[], Any]]]:
    out = []
    for p in policies:
        if p == LLAMA_SERVER:
            out.append((p, lambda: servers.llama_server(model, spec.agents, context_per_agent(spec))))
        else:
            out.append((p, lambda p=p: servers.agentserve(model, p, server_args)))
    return out


def per_repeat_ratios(runs: dict[str, list[RunRecord]], slo: SLO) -> list[dict[str, Any]]:
    """Each repeat's headline ratios (system / reference), so the spread between repeats is visible.

    Every system in ``runs`` has one run per repeat (``run_systems`` drops a system that failed)."""
    keys = ("tpot_p95", "ttft_resume_p95", "throughput_tok_s")
    out = []
    for repeat in zip(*runs.values(), strict=True):
        figs = {name: aggregate(run, slo) for name, run in zip(runs, repeat, strict=True)}
        ref = figs[reporting.reference_of(figs)]
        ratios = {name: reporting.ratios(f, ref) for name, f in figs.items()}
        out.append({name: {k: r[k] for k in keys} for name, r in ratios.items()})
    return out


async def _drive(target: servers.Target, workload: Workload, duration: float, timeout_s: float,
                 progress: Progress, task: Any, label: str) -> RunRecord:
    driver = target.make_driver()
    connect = getattr(driver, "connect", None)
    if connect is not None:
        await connect()
    count = 0

    def on_request(_):
        nonlocal count
        count += 1

    async def tick():
        t0 = time.perf_counter()
        while True:
            progress.update(task, completed=min(time.perf_counter() - t0, duration),
                            description=f"{label}: {count} requests")
            await asyncio.sleep(0.5)

    ticker = asyncio.create_task(tick())
    try:
        return await run_closed_loop(driver, workload, duration, request_timeout_s=timeout_s,
                                     on_request=on_request)
    finally:
        ticker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ticker
        progress.update(task, completed=duration, description=f"{label}: {count} requests")
        await driver.aclose()


def run_systems(systems: list[tuple[str, Callable[[], Any]]], spec: WorkloadSpec, repeats: int, warmup: float,
                duration: float, timeout_s: float, console: Console) -> tuple[dict[str, list[RunRecord]], list[str]]:
    """Each system ``repeats`` times, interleaved; its runs (warm-up cut off), and the systems that failed."""
    runs: dict[str, list[RunRecord]] = {}
    failed: list[str] = []
    columns = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        for rep in range(repeats):
            workload = Workload(dataclasses.replace(spec, seed=spec.seed + rep))
            for name, launch in systems:
                if name in failed:
                    continue
                label = name if repeats == 1 else f"{name} ({rep + 1}/{repeats})"
                task = progress.add_task(f"{label}: starting", total=warmup + duration)
                try:
                    with launch() as tgt:
                        run = asyncio.run(_drive(tgt, workload, warmup + duration, timeout_s, progress, task,
                                                 label))
                    runs.setdefault(name, []).append(after_warmup(run, warmup))
                except Exception as e:  # noqa: BLE001 - report this system as failed, go on with the next
                    console.print(f"{label}: {type(e).__name__}: {e}", style="red", markup=False)
                    if not isinstance(e, servers.ServerFailed):  # not the system's fault: show where
                        console.print_exception()
                    failed.append(name)
                    runs.pop(name, None)
    return runs, failed


@click.command("bench")
@click.option("--workload", default="react", show_default=True, help="react | plan-execute | a TOML file")
@click.option("--agents", type=int, default=None, help="concurrent agents [default: the workload's]")
@click.option("--policies", default="agentserve,fcfs", show_default=True,
              help="comma-separated: AgentServe scheduler policies (agentserve, fcfs, chunked, llamacpp, "
                   "...; each a fresh `agentserve up`) and/or llama-server (llama.cpp's own server on "
                   "the same weights as GGUF, see scripts/compare_llamacpp.sh)")
@click.option("--duration", type=float, default=120.0, show_default=True, help="measured seconds per system")
@click.option("--warmup", type=float, default=0.0, show_default=True,
              help="seconds run before the measured window (its requests are not counted)")
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="run every system this many times, interleaved (A B A B ...), seed + i in repeat i; "
                   "figures pool all requests, the JSON also lists each repeat's ratios")
@click.option("--model", default="bench", show_default=True, help="built-in model or checkpoint folder")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="write the report")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None, help="write PNG plots")
@click.option("--target", default=None, help="benchmark an external server at http://HOST:PORT instead")
@click.option("--target-dialect", type=click.Choice(["openai", "llamacpp", "chat"]), default="openai",
              show_default=True, help="/v1/completions (token ids), llama.cpp's native /completion, or "
                                      "/v1/chat/completions (text; what a router such as sglang-router takes)")
@click.option("--target-model", default=None, help="the `model` field sent to --target")
@click.option("--tool-latency-median", type=float, default=None, help="seconds (log-normal median)")
@click.option("--tool-latency-sigma", type=float, default=None, help="log-normal sigma")
@click.option("--steps", type=int, default=None, help="LLM turns per agent task")
@click.option("--seed", type=int, default=None)
@click.option("--ttft-slo-ms", type=float, default=2000.0, show_default=True)
@click.option("--tpot-slo-ms", type=float, default=100.0, show_default=True)
@click.option("--request-timeout", type=float, default=300.0, show_default=True, help="seconds per turn")
@click.option("--server-arg", "server_args", multiple=True, help="extra argument for `agentserve up`")
def bench(workload: str, agents: int | None, policies: str, duration: float, warmup: float, repeats: int,
          model: str,
          json_path: str | None, plot_path: str | None, target: str | None, target_dialect: str,
          target_model: str | None, tool_latency_median: float | None, tool_latency_sigma: float | None,
          steps: int | None, seed: int | None, ttft_slo_ms: float, tpot_slo_ms: float,
          request_timeout: float, server_args: tuple[str, ...]) -> None:
    """Run closed-loop agents against each system for --duration seconds and compare them."""
    if plot_path and importlib.util.find_spec("matplotlib") is None:
        raise click.ClickException("--plot needs matplotlib: pip install matplotlib")
    spec = load_spec(workload, agents=agents, seed=seed, steps_per_task=steps,
                     tool_latency_median_s=tool_latency_median, tool_latency_sigma=tool_latency_sigma)
    slo = SLO(ttft_slo_ms / 1000.0, tpot_slo_ms / 1000.0)
    if target:
        systems = [("target", lambda: servers.external(target, target_dialect, target_model))]
    else:
        names = [p.strip() for p in policies.split(",") if p.strip()]
        # Each AgentServe server steers by the SLO this benchmark measures (flags given later win).
        steer = ["--tpot-slo-ms", str(tpot_slo_ms), "--ttft-slo-ms", str(ttft_slo_ms)]
        systems = launchers(names, model, spec, [*steer, *server_args])
    console = Console()
    runs, failed = run_systems(systems, spec, repeats, warmup, duration, request_timeout, console)
    if not runs:
        raise click.ClickException("no system could be benchmarked")
    pooled = {name: pool(r) for name, r in runs.items()}
    figures = {name: aggregate(run, slo) for name, run in pooled.items()}
    meta = {"workload": spec.name, "agents": spec.agents, "duration_s": duration, "warmup_s": warmup,
            "model": (target_model or "external") if target else model,
            "steps_per_task": spec.steps_per_task, "seed": spec.seed,
            "tool_latency": {"median_s": spec.tool_latency.median_s, "sigma": spec.tool_latency.sigma},
            "slo": {"ttft_ms": ttft_slo_ms, "tpot_ms": tpot_slo_ms}, "target": target, "failed": failed,
            "repeats": repeats}
    if repeats > 1:
        meta["per_repeat_ratios"] = per_repeat_ratios(runs, slo)
    rep = reporting.build(figures, meta)
    reporting.print_table(rep, console)
    if json_path:
        reporting.write_json(rep, json_path)
        console.print(f"wrote {json_path}")
    if plot_path:
        from agentserve.bench.plots import plot

        plot(pooled, plot_path)
        console.print(f"wrote {plot_path}")
    errors = {n: f["errors"] for n, f in figures.items() if f["errors"] or not f["requests"]}
    if failed or errors:
        raise click.ClickException(f"failed to start: {failed or 'none'}; "
                                   f"systems with errors: {errors or 'none'}")
