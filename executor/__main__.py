"""``python -m agentserve.executor --run RUN --model DIR`` — the executor process; ``agentserve up`` starts it."""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import sys

from agentserve.configs.logging import setup_logging
from agentserve.executor.process import ExecutorOptions, run_executor


def parse(argv: list[str]) -> tuple[ExecutorOptions, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="python -m agentserve.executor")
    p.add_argument("--run", required=True)
    p.add_argument("--role", default="exec0")
    p.add_argument("--model", required=True, help="checkpoint folder (already resolved)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--kv-cache-bytes", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--partition", default=None)
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--log-json", action="store_true")
    a = p.parse_args(argv)
    opts = ExecutorOptions(
        run=a.run,
        model_dir=a.model,
        role=a.role,
        dtype=a.dtype,
        device=a.device,
        block_size=a.block_size,
        num_blocks=a.num_blocks,
        kv_cache_bytes=a.kv_cache_bytes,
        max_model_len=a.max_model_len,
        partition=a.partition,
    )
    return opts, a


def main(argv: list[str] | None = None) -> int:
    opts, a = parse(sys.argv[1:] if argv is None else argv)
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
