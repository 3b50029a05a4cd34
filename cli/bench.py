"""``agentserve bench``: the same closed-loop agent workload against each system, side by side, at one
agent count or swept over several (``--agents 1,2,4``); ``--report DIR`` writes the paper report."""

from __future__ import annotations

import importlib.util
import math
import os
import shlex
import signal
import time
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from agentserve import configs
from agentserve.bench import machine as machine_info
from agentserve.bench import report as reporting
from agentserve.bench import runner, servers, sweep, sweep_report
from agentserve.bench.metrics import SLO, RunRecord
from agentserve.bench.progress import SweepProgress, duration_text
from agentserve.bench.workload import WorkloadSpec, load_spec
from agentserve.cli.interrupts import interrupt_on_sigterm

context_per_agent = runner.context_per_agent


def system_names(policies: str) -> list[str]:
    """The ``--policies`` list, checked: AgentServe's policies and ``llama-server``."""
    from agentserve.orchestrator.policies import POLICY_NAMES

    names = [p.strip() for p in policies.split(",") if p.strip()]
    valid = (*POLICY_NAMES, runner.LLAMA_SERVER)
    unknown = [n for n in names if n not in valid]
    if unknown or not names:
        raise click.BadParameter(f"unknown system(s) {', '.join(unknown) or '(none given)'}; valid: "
                                 f"{', '.join(valid)}", param_hint="--policies")
    if len(set(names)) != len(names):
        raise click.BadParameter("a system is listed twice", param_hint="--policies")
    return names


def finite(low: float, low_open: bool = False) -> Any:
    """A click callback: the value is a finite number >= ``low`` (> with ``low_open``); nan and inf are refused."""

    def check(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
        if value is not None and not (math.isfinite(value) and (value > low if low_open else value >= low)):
            raise click.BadParameter(f"must be a finite number {'>' if low_open else '>='} {low:g}, got {value}")
        return value

    return check


def _check_writable_folder(path: str | None, flag: str) -> None:
    if path is None:
        return
    folder = Path(path).resolve().parent
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise click.BadParameter(f"cannot write into {folder} (no such folder, or not writable)", param_hint=flag)


def command_line(ctx: click.Context) -> str:
    """The options this run was given (not their defaults), as a command a person can rerun."""
    words = ["agentserve", "bench"]
    for param in ctx.command.params:
        source = ctx.get_parameter_source(param.name)
        value = ctx.params.get(param.name)
        if source in (None, click.core.ParameterSource.DEFAULT) or value in (None, False, ()):
            continue
        flag = param.opts[0]
        for v in value if isinstance(value, tuple) else (value,):
            words += [flag] if v is True else [flag, str(v)]
    return shlex.join(words)


def detail_plot_path(plot_path: str, agents: int) -> Path:
    """Where a sweep puts the CDF / timeline figure of its largest agent count: ``s.png`` → ``s-agents6.png``."""
    p = Path(plot_path)
    return p.with_name(f"{p.stem}-agents{agents}{p.suffix or '.png'}")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _base_meta(spec: WorkloadSpec, model: str, duration: float, warmup: float, repeats: int, slo: SLO,
               target: str | None) -> dict[str, Any]:
    return {"workload": spec.name, "duration_s": duration, "warmup_s": warmup, "model": model,
            "steps_per_task": spec.steps_per_task, "seed": spec.seed,
            "tool_latency": {"median_s": spec.tool_latency.median_s, "sigma": spec.tool_latency.sigma},
            "slo": {"ttft_ms": slo.ttft_s * 1000.0, "tpot_ms": slo.tpot_s * 1000.0}, "target": target,
            "repeats": repeats}


def _announce(console: Console, slots: list[sweep.RunSlot], run_s: float) -> None:
    counts, systems, repeats = ({getattr(s, k) for s in slots} for k in ("agents", "system", "repeat"))
    console.print(f"{len(slots)} runs ({len(counts)} agent count(s) × {len(systems)} system(s) × {len(repeats)} "
                  f"repeat(s)) of {run_s:g} s: {duration_text(len(slots) * run_s)} measured, plus a server "
                  f"start and drain per run")


def run_sweep(console: Console, spec: WorkloadSpec, counts: list[int], systems: list[str], repeats: int,
              warmup: float, duration: float, timeout_s: float, launch: sweep.Launch) -> sweep.SweepRuns:
    """Every system at every agent count, with a progress display across the whole sweep."""
    slots = sweep.plan(counts, systems, repeats, spec.seed)
    _announce(console, slots, warmup + duration)
    with SweepProgress(console, slots, warmup + duration, repeats, (servers.ServerFailed,)) as progress:
        drive = runner.driver(warmup, duration, timeout_s, progress.tick)
        return sweep.execute(slots, spec, launch, drive, progress.on_event)


def _write_plots(plot_path: str, out: dict[str, Any], pooled: dict[int, dict[str, RunRecord]], slo: SLO,
                 console: Console) -> dict[str, str]:
    from agentserve.bench import plots, sweep_plots

    largest = max(pooled)
    meta = out["meta"]
    title = (f"{meta['workload']}, {largest} agents, model {meta['model']}: SLO TTFT {slo.ttft_s * 1000:g} ms, "
             f"TPOT {slo.tpot_s * 1000:g} ms")
    written = {}
    if "rows" in out:
        sweep_plots.plot(out, plot_path)
        written["sweep"] = plot_path
        detail = str(detail_plot_path(plot_path, largest))
    else:
        detail = plot_path
    plots.plot(pooled[largest], detail, slo, title)
    written[f"agents{largest}"] = detail
    for path in written.values():
        console.print(f"wrote {path}")
    return written


def _relative(paths: dict[str, str], json_path: str | None) -> dict[str, str]:
    base = Path(json_path).resolve().parent if json_path else Path.cwd()
    return {k: os.path.relpath(Path(p).resolve(), base) for k, p in paths.items()}


def _finish(console: Console, runs: sweep.SweepRuns, counts: list[int], base_meta: dict[str, Any], slo: SLO,
            command: str, json_path: str | None, plot_path: str | None) -> dict[str, Any]:
    points, pooled = [], {}
    for n in counts:
        if runs.at(n):
            meta = {**base_meta, "agents": n, "failed": runs.failed.get(n, [])}
            point, pooled[n] = runner.point_report(runs.at(n), slo, meta)
            points.append(point)
    if not points:
        raise click.ClickException("no system could be benchmarked")
    ended = {"command": command, "finished": _now(), "loadavg_end": list(os.getloadavg())}
    if len(counts) == 1:
        out = points[0]
        out["meta"].update(ended)
        reporting.print_table(out, console)
    else:
        out = sweep_report.build(points, {**ended, "failed": {str(n): names for n, names in runs.failed.items()}})
        for r in out["rows"]:
            console.print(sweep_report.headline_table(r, out["reference"], out["meta"]["slo"]))
    if plot_path:
        out["meta"]["plots"] = _relative(_write_plots(plot_path, out, pooled, slo, console), json_path)
    if json_path:
        reporting.write_json(out, json_path)
        console.print(f"wrote {json_path}")
    return out


def _check_errors(out: dict[str, Any], runs: sweep.SweepRuns) -> None:
    errors, short = {}, {}
    for point in sweep_report.as_sweep(out)["points"]:
        for name, f in point["policies"].items():
            if f["errors"] or not f["requests"]:
                errors[f"{name} @ {point['meta']['agents']}"] = f["errors"]
            if f.get("short_replies"):
                short[f"{name} @ {point['meta']['agents']}"] = f["short_replies"]
    if runs.failed or errors or short:
        failed = {n: names for n, names in runs.failed.items()} or "none"
        raise click.ClickException(f"systems that failed (agents: systems): {failed}; "
                                   f"systems with request errors: {errors or 'none'}; systems whose replies stopped "
                                   f"short of max_tokens (ignore_eos ignored, a context too small, or several tokens "
                                   f"a chunk without usage: figures not comparable): {short or 'none'}")


@click.command("bench")
@click.option("--workload", default="react", show_default=True, help="react | plan-execute | a TOML file")
@click.option("--agents", default=None,
              help="concurrent agents, or a comma list to sweep (1,2,3,4,5,6) [default: the workload's]")
@click.option("--policies", default="agentserve,fcfs", show_default=True,
              help="comma-separated: AgentServe scheduler policies (agentserve, no-feedback, no-partition, "
                   "chunked, fcfs, llamacpp; each a fresh `agentserve up`) and/or llama-server (llama.cpp's "
                   "own server on the same weights as GGUF, see scripts/compare_llamacpp.sh)")
@click.option("--duration", type=float, default=120.0, show_default=True, callback=finite(0, low_open=True),
              help="measured seconds per run")
@click.option("--warmup", type=float, default=0.0, show_default=True, callback=finite(0),
              help="seconds run before the measured window (its requests are not counted)")
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="run every system this many times per agent count, interleaved (A B, B A, ...), seed + i "
                   "in repeat i; figures pool all requests, the JSON also lists each repeat's ratios")
@click.option("--model", default="bench", show_default=True, help="built-in model or checkpoint folder")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="write the report")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="write PNG plots (a sweep also writes STEM-agentsN.png: CDFs at its largest count)")
@click.option("--report", "report_dir", type=click.Path(file_okay=False, exists=True), default=None,
              help="run nothing: write DIR/paper.md from the bench JSON files in DIR (the paper's claims "
                   "beside the figures measured)")
@click.option("--report-out", type=click.Path(dir_okay=False), default=None,
              help="where --report writes [default: DIR/paper.md]")
@click.option("--target", default=None, help="benchmark an external server at http://HOST:PORT instead")
@click.option("--target-dialect", type=click.Choice(["openai", "llamacpp", "chat"]), default="openai",
              show_default=True, help="/v1/completions (token ids), llama.cpp's native /completion, or "
                                      "/v1/chat/completions (text; what a router such as sglang-router takes)")
@click.option("--target-model", default=None, help="the `model` field sent to --target")
@click.option("--tool-latency-median", type=float, default=None, callback=finite(0),
              help="seconds (log-normal median)")
@click.option("--tool-latency-sigma", type=float, default=None, callback=finite(0), help="log-normal sigma")
@click.option("--steps", type=click.IntRange(min=1), default=None, help="LLM turns per agent task")
@click.option("--seed", type=int, default=None)
@click.option("--ttft-slo-ms", type=float, default=2000.0, show_default=True, callback=finite(0, low_open=True))
@click.option("--tpot-slo-ms", type=float, default=100.0, show_default=True, callback=finite(0, low_open=True))
@click.option("--request-timeout", type=float, default=300.0, show_default=True, callback=finite(0, low_open=True),
              help="seconds per turn")
@click.option("--server-arg", "server_args", multiple=True, help="extra argument for `agentserve up`")
@click.option("--keep-logs", type=click.Path(file_okay=False), default=None,
              help="keep each server's log in this folder, as WORKLOAD-SYSTEM-agentsN-seedS.log")
@click.pass_context
def bench(ctx: click.Context, workload: str, agents: str | None, policies: str, duration: float, warmup: float,
          repeats: int, model: str, json_path: str | None, plot_path: str | None, report_dir: str | None,
          report_out: str | None, target: str | None, target_dialect: str, target_model: str | None,
          tool_latency_median: float | None, tool_latency_sigma: float | None, steps: int | None,
          seed: int | None, ttft_slo_ms: float, tpot_slo_ms: float, request_timeout: float,
          server_args: tuple[str, ...], keep_logs: str | None) -> None:
    """Run closed-loop agents against each system for --duration seconds and compare them."""
    before = interrupt_on_sigterm()  # its servers and temporary folders are removed on a SIGTERM as on a Ctrl-C
    ctx.call_on_close(lambda: signal.signal(signal.SIGTERM, before))  # a caller's own handler back (CliRunner)
    if report_dir:
        from agentserve.bench import paper

        _check_writable_folder(report_out, "--report-out")
        try:
            out = paper.write_report(Path(report_dir), Path(report_out) if report_out else None)
        except ValueError as e:
            raise click.ClickException(str(e)) from None
        click.echo(f"wrote {out}")
        return
    if plot_path and importlib.util.find_spec("matplotlib") is None:
        raise click.ClickException("--plot needs matplotlib: pip install matplotlib")
    try:
        counts = sweep.parse_agent_counts(agents) if agents else None
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--agents") from None
    try:
        spec = load_spec(workload, agents=counts[0] if counts else None, seed=seed, steps_per_task=steps,
                         tool_latency_median_s=tool_latency_median, tool_latency_sigma=tool_latency_sigma)
    except (configs.ConfigError, ValueError) as e:
        raise click.BadParameter(str(e), param_hint="--workload") from None
    for path, flag in ((json_path, "--json"), (plot_path, "--plot")):
        _check_writable_folder(path, flag)  # now, not after the runs
    counts = counts or [spec.agents]
    slo = SLO(ttft_slo_ms / 1000.0, tpot_slo_ms / 1000.0)
    systems = [runner.TARGET] if target else system_names(policies)
    # Each AgentServe server steers by the SLO this benchmark measures (flags given later win).
    steer = ["--tpot-slo-ms", str(tpot_slo_ms), "--ttft-slo-ms", str(ttft_slo_ms)]
    logs = Path(keep_logs) if keep_logs else None
    if logs is not None:
        try:
            logs.mkdir(parents=True, exist_ok=True)  # fail now, not after the first run
        except OSError as e:
            raise click.BadParameter(str(e), param_hint="--keep-logs") from None
    launch = runner.launcher(model, [*steer, *server_args], target, target_dialect, target_model, logs)
    console = Console()
    if not console.is_terminal:  # a log file: room for a column per system
        console = Console(width=160)
    console.print(f"machine: {machine_info.one_line(machine_info.describe())}", markup=False)
    # when it began and how busy the machine was then (the report adds the end)
    began = {"date": _now(), "loadavg_1_5_15": list(os.getloadavg())}
    runs = run_sweep(console, spec, counts, systems, repeats, warmup, duration, request_timeout, launch)
    meta = {**_base_meta(spec, (target_model or "external") if target else model, duration, warmup, repeats, slo,
                         target), **began}
    out = _finish(console, runs, counts, meta, slo, command_line(ctx), json_path, plot_path)
    _check_errors(out, runs)
