"""``agentserve up``: start the orchestrator and its executor process and serve agent clients.

Precedence for every setting: built-in defaults (``configs/*.toml``) < ``--config FILE`` <
``AGENTSERVE_<SECTION>_<KEY>`` environment variables < command-line flags.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import time
from typing import Any

import click

from agentserve import configs
from agentserve.cli.engine_options import engine_config, engine_flags
from agentserve.cli.gateway_process import GatewayProcess, parse_http
from agentserve.cli.up_signals import ForcedStop, hold_signals, ignore_signals, interrupt, on_signals
from agentserve.configs.logging import LOG_LEVELS, setup_logging
from agentserve.executor.errors import EngineError
from agentserve.orchestrator.executor_link import ExecutorLink, ExecutorSpec, ExecutorStartError
from agentserve.orchestrator.ingress import Ingress
from agentserve.orchestrator.limits import ServingLimits, load_limits
from agentserve.orchestrator.policies import POLICIES
from agentserve.orchestrator.scheduler.config import load_config
from agentserve.orchestrator.server import ExecutorDownError, Server, ServerBroken, ServerOptions
from agentserve.orchestrator.stats_publisher import StatsPublisher
from agentserve.orchestrator.step_trace import StepTrace
from agentserve.orchestrator.text.tokenization import Tokenizer
from agentserve.protocol.client_messages import Welcome
from agentserve.protocol.endpoints import EndpointError, default_endpoint, ipc_path
from agentserve.shm.board import list_runs
from agentserve.shm.errors import ShmError
from agentserve.shm.segment import check_run, cleanup_stale, run_cleanups

log = logging.getLogger("agentserve.up")


def _executor_args(engine: dict[str, Any], partition: str | None) -> list[str]:
    args: list[str] = []
    for key in ("dtype", "weights", "kv_cache_dtype", "attention_backend", "decode_step", "decode_helper",
                "prefill_attention", "device", "block_size"):
        args += ["--" + key.replace("_", "-"), str(engine[key])]
    for key in ("num_blocks", "max_model_len"):  # 0 / unset: the executor derives them
        if engine.get(key):
            args += ["--" + key.replace("_", "-"), str(engine[key])]
    if engine.get("cuda_graphs", "auto") != "auto":
        args += ["--cuda-graphs", str(engine["cuda_graphs"])]
    if engine.get("kv_cache_memory_gb"):
        args += ["--kv-cache-bytes", str(int(float(engine["kv_cache_memory_gb"]) * 2**30))]
    args += ["--memory-utilization", str(engine["gpu_memory_utilization"]),  # how big the cache is when not given
             "--cpu-kv-fraction", str(engine["kv_cache_fraction"]),
             "--cpu-kv-cap-bytes", str(int(float(engine["kv_cache_max_gb_cpu"]) * 2**30))]
    if partition:
        args += ["--partition", partition]
    return args


def _resolve_model(name: str, cache_dir: str) -> str:
    from agentserve.executor.builtin import resolve_model  # torch-free: writes a checkpoint folder

    return str(resolve_model(name, cache_dir or None))


@click.command("up")
@click.option("--model", default=None, help="Checkpoint folder, or a built-in model: tiny | bench.")
@click.option("--policy", type=click.Choice(sorted(POLICIES)), default=None, help="Scheduling policy.")
@click.option("--endpoint", default=None, help="ipc://PATH or tcp://127.0.0.1:PORT (default: an ipc socket).")
@click.option("--allow-remote", is_flag=True, help="Allow binding a non-loopback TCP address.")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None, help="A TOML file.")
@click.option("--tpot-slo-ms", type=click.FloatRange(min=0, min_open=True), default=None,
              help="TPOT target the controller steers by.")
@click.option("--ttft-slo-ms", type=click.FloatRange(min=0, min_open=True), default=None,
              help="TTFT objective (reported).")
@engine_flags
@click.option("--num-blocks", type=click.IntRange(min=1), default=None,
              help="KV cache size in blocks (default: from memory).")
@click.option("--kv-cache-gb", type=click.FloatRange(min=0, min_open=True), default=None, help="KV cache size in GiB.")
@click.option("--max-model-len", type=click.IntRange(min=2), default=None, help="Context length cap.")
@click.option("--partition", type=click.Choice(["green-ctx", "cuda-streams", "cpu-cores"]), default=None)
@click.option("--run", "run_name", default="default", show_default=True, help="Run name (`agentserve top --run`).")
@click.option("--no-restart", is_flag=True, help="Exit instead of restarting a crashed executor.")
@click.option("--trace-steps", type=click.Path(dir_okay=False), default=None,
              help="Append one JSON line per executor step to this file (lane, rung, times, tokens, policy state).")
@click.option("--http", "http", default=None, metavar="HOST:PORT",
              help="Also serve the OpenAI-compatible HTTP API here (loopback unless --allow-remote).")
@click.option("--api-key", default=None, envvar="AGENTSERVE_API_KEY",
              help="With --http: require `Authorization: Bearer KEY` (not on /health, /metrics).")
@click.option("--served-model-name", default=None, help="With --http: the model name clients send.")
@click.option("--metrics-compat", type=click.Choice(["vllm"]), default=None,
              help="With --http: also emit every metric under vLLM's `vllm:` names.")
@click.option("--log-level", type=click.Choice(LOG_LEVELS, case_sensitive=False), default="INFO", show_default=True)
@click.option("--log-json", is_flag=True, help="JSON log lines.")
def up(**opts: Any) -> None:
    """Serve agent clients over ZeroMQ on one GPU (or the CPU)."""
    if opts["num_blocks"] and opts["kv_cache_gb"]:
        raise click.UsageError("give --num-blocks or --kv-cache-gb, not both (each sets the KV cache's size)")
    setup_logging(opts["log_level"], opts["log_json"])
    try:
        code = _up(opts)
    except (configs.ConfigError, EndpointError, EngineError, ExecutorStartError, ShmError, ValueError) as e:
        click.echo(f"agentserve up: {e}", err=True)  # a missing model, a bad flag: one line, exit 2
        code = 2
    except KeyboardInterrupt:  # SIGINT / SIGTERM / SIGHUP while starting: everything was cleaned up on the way out
        log.info("stopped while starting")
        code = 0
    sys.exit(code)


def _configs(opts: dict[str, Any]) -> tuple[dict[str, Any], Any, ServingLimits]:
    given = {k: opts[k] for k in ("model", "dtype", "weights", "device", "num_blocks", "max_model_len")}
    engine = engine_config(opts["config_file"], given | {"kv_cache_memory_gb": opts["kv_cache_gb"]})
    sched_overrides: dict[str, Any] = {}
    if opts["policy"]:
        sched_overrides["scheduler"] = {"policy": opts["policy"]}
    slo = {k: opts[f] for k, f in (("tpot_target_ms", "tpot_slo_ms"), ("ttft_target_ms", "ttft_slo_ms"))
           if opts[f] is not None}
    if slo:
        sched_overrides["slo"] = slo
    return engine, load_config(opts["config_file"], sched_overrides), load_limits(opts["config_file"])


def _up(opts: dict[str, Any]) -> int:
    engine, sched_config, limits = _configs(opts)
    run = check_run(opts["run_name"])  # before anything is named after it
    removed = cleanup_stale()
    if removed:
        log.info("removed %d shared-memory leftovers of dead runs", len(removed))
    if run in list_runs():  # its segments' names are taken: say whose, before binding anything
        raise ValueError(f"run {run!r} is already being served on this machine (`agentserve top --run {run}`): "
                         "stop it or pick another --run")
    http = parse_http(opts["http"], opts["allow_remote"]) if opts["http"] else None
    model_dir = _resolve_model(str(engine["model"]), str(engine.get("cache_dir", "")))
    tokenizer = Tokenizer.from_dir(model_dir)
    policy = sched_config.scheduler.policy
    held = hold_signals()  # from the socket's bind until on_signals below
    ingress = Ingress(
        opts["endpoint"] or default_endpoint(run), allow_remote=opts["allow_remote"], limits=limits.request,
        rules=limits.clients,
    )
    publisher = link = trace = gateway = None
    stopped = False  # the loop ended on a stop: the clean-up that follows is the last thing left
    forced = ForcedStop(lambda: (m.proc for m in (link, gateway) if m is not None), ipc_path(ingress.endpoint))
    try:
        if opts["trace_steps"]:  # before the model loads: a bad path fails at once
            trace = StepTrace(opts["trace_steps"])
        publisher = StatsPublisher(
            run, ingress.endpoint, model_dir, sched_config.slo.tpot_target_ms, sched_config.slo.ttft_target_ms
        )
        spec = ExecutorSpec(
            run, model_dir, _executor_args(engine, opts["partition"]), opts["log_level"], opts["log_json"]
        )
        link = ExecutorLink(spec, limits.executor)
        # until the loop runs: stop loading and clean up through `finally`; a signal held since the socket's bind is
        # acted on here, once what was made so far is assigned (an exception inside a constructor leaked its segment)
        on_signals(interrupt, forced, held)
        t0 = time.monotonic()
        with _Status(as_log=opts["log_json"]) as status:
            ready = link.start(progress=lambda s: status.update(f"loading the model … {s:.0f} s"))
        _warn_if_clamped(engine.get("max_model_len"), ready.max_model_len)
        ingress.info = Welcome(
            0, 0, server="agentserve", model=model_dir, max_model_len=ready.max_model_len, run=run, pid=os.getpid(),
            eos_token_ids=list(ready.eos_token_ids), vocab_size=ready.vocab_size,
        )
        server = Server(
            ingress, link, tokenizer,
            ServerOptions(policy, sched_config, restart=not opts["no_restart"], limits=limits), publisher,
            trace=trace,
        )
        on_signals(server.stop, forced)
        if http is not None:
            gateway = GatewayProcess(ingress.endpoint, *http, _gateway_args(opts, str(engine["model"]), limits),
                                     opts["log_level"], api_key=opts["api_key"] or "",
                                     log_json=opts["log_json"]).start()
            publisher.info.http = gateway.url
        gc.collect()
        gc.freeze()  # start-up objects never need scanning again: fewer long GC pauses in the loop
        _say_ready(
            f"AgentServe ready on {ingress.endpoint} · model {model_dir} · policy {policy} · "
            f"{ready.backend} ({len(ready.ladder)} rungs) · {ready.device} · "
            f"KV {ready.num_blocks * ready.block_size} tokens · "
            f"loaded in {time.monotonic() - t0:.1f} s · run {run}"
            + (f" · HTTP {gateway.url}" if gateway is not None else "")
        )
        try:
            server.serve()
        except ExecutorDownError as e:
            click.echo(f"agentserve up: executor died and --no-restart is set: {e}", err=True)
            return 1
        except ServerBroken as e:
            click.echo(f"agentserve up: internal error, stopped after ending every turn: {e}", err=True)
            return 3
        stopped = True
        return 0
    finally:
        forced.arm()  # one stop is enough: a signal during the clean-up forces it (SIGKILL, everything still removed)
        if gateway is not None:
            gateway.stop()
        ingress.close()  # before the executor's stop (up to its grace): a client's request then fails at once
        if link is not None:
            link.close()
        if publisher is not None:
            publisher.close()
        if trace is not None:
            trace.close()
        run_cleanups()  # what a stop cut off mid-construction made (a board whose publisher never was assigned)
        ignore_signals()  # done: a signal from here to the exit changes nothing
        if stopped:  # said once the clean-up is done: a forced one exits before this
            log.info("shut down cleanly")


def _say_ready(line: str) -> None:
    """The ready line, on stdout for the scripts that wait for it.  A stdout nobody can write to any more (a pipe
    whose reader is gone, a full disk) does not stop a server that has loaded: the line goes to the log instead, and
    stdout to /dev/null (nothing else is written there)."""
    try:
        click.echo(line)
        sys.stdout.flush()
    except OSError as e:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        log.warning("stdout cannot be written (%s); serving all the same: %s", e, line)


def _warn_if_clamped(asked: Any, serving: int) -> None:
    """The executor caps max_model_len at the model's context without a word: say so, with both numbers."""
    if asked and int(asked) > serving:
        log.warning("max_model_len %d is more than the model's context of %d tokens: serving %d-token contexts",
                    int(asked), serving, serving)


def _gateway_args(opts: dict[str, Any], model: str, limits: ServingLimits) -> list[str]:
    args = ["--allow-remote"] if opts["allow_remote"] else []
    args += ["--tokenize-inline-bytes", str(limits.clients.tokenize_inline_bytes),
             "--max-tokenizing-bytes", str(limits.clients.max_tokenizing_bytes)]
    args += ["--served-model-name", opts["served_model_name"] or model]
    if opts["metrics_compat"]:
        args += ["--metrics-compat", opts["metrics_compat"]]
    return args


class _Status:
    """A one-line spinner on stderr while the executor loads (plain lines when not a terminal, log records every
    10 s with ``as_log``: ``--log-json`` keeps stderr all JSON)."""

    def __init__(self, as_log: bool = False) -> None:
        self._as_log = as_log

    def __enter__(self) -> _Status:
        from rich.console import Console

        self._console = Console(stderr=True)
        spin = self._console.is_terminal and not self._as_log
        self._status = self._console.status("starting the executor …") if spin else None
        if self._status is not None:
            self._status.__enter__()
        self._last = -10.0
        return self

    def update(self, text: str) -> None:
        if self._status is not None:
            self._status.update(text)
            return
        elapsed = time.monotonic()
        if elapsed - self._last >= 10.0:
            self._last = elapsed
            if self._as_log:
                log.info("%s", text)
            else:
                self._console.print(text)

    def __exit__(self, *exc: object) -> None:
        if self._status is not None:
            self._status.__exit__(*exc)
