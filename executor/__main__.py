"""``python -m agentserve.executor --run RUN --model DIR`` — the executor process; ``agentserve up`` starts it."""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import sys
from typing import TYPE_CHECKING

from agentserve.executor.memory import configure_cuda_allocator

if TYPE_CHECKING:
    from agentserve.executor.process import ExecutorOptions


def choose_allocator() -> tuple[str, str]:
    """:func:`configure_cuda_allocator`'s choice and ``""``, or ``""`` and why ``AGENTSERVE_CUDA_ALLOCATOR`` is
    refused (reported to the orchestrator once the rings are attached).

    Runs first in :func:`main`, before anything imports torch: torch (2.11) fixes its CUDA allocator backend
    from ``PYTORCH_CUDA_ALLOC_CONF`` when it loads, and a value set later fails CUDA's start ("Allocator backend
    parsed at runtime != allocator backend parsed at load time").  Importing this module chooses nothing."""
    try:
        return configure_cuda_allocator(), ""
    except ValueError as e:
        return "", str(e)


def parse(argv: list[str], allocator: str = "native", allocator_error: str = "") -> tuple[ExecutorOptions,
                                                                                          argparse.Namespace]:
    from agentserve.executor.process import RUNNER_OPTIONS, ExecutorOptions

    p = argparse.ArgumentParser(prog="python -m agentserve.executor")
    p.add_argument("--run", required=True)
    p.add_argument("--role", default="exec0")
    p.add_argument("--model", required=True, help="checkpoint folder (already resolved)")
    for name, kind in RUNNER_OPTIONS:  # unset ones keep ModelRunner's defaults
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None)
    p.add_argument("--partition", default=None)
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--log-json", action="store_true")
    a = p.parse_args(argv)
    runner = {name: getattr(a, name) for name, _ in RUNNER_OPTIONS if getattr(a, name) is not None}
    opts = ExecutorOptions(run=a.run, model_dir=a.model, role=a.role, partition=a.partition, runner=runner,
                           allocator=allocator, allocator_error=allocator_error)
    return opts, a


def main(argv: list[str] | None = None) -> int:
    allocator, allocator_error = choose_allocator()  # first: the imports below load torch
    from agentserve.configs.logging import setup_logging
    from agentserve.executor.process import run_executor

    opts, a = parse(sys.argv[1:] if argv is None else argv, allocator, allocator_error)
    multiprocessing.current_process().name = "executor"
    setup_logging(a.log_level, a.log_json)
    return run_executor(opts)


if __name__ == "__main__":
    code = main()
    # Everything was closed explicitly; skip the interpreter's teardown (torch's takes ~2 s), so the
    # process is gone well within a second of the decision to stop.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
