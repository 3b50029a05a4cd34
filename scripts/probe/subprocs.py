"""Sections run as child processes: ``gemm_lanes`` (which matrix products run on each lane's stream; a
failure may leave cuBLAS unusable in its process), ``ring`` (shared-memory ring vs ZeroMQ, with a spinning
reader, on the device box's 16 cores) and ``pytest_gpu`` (the test suite's GPU tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from probe.common import Context

RING_ARGS = ["--json", "--latency-msgs", "5000", "--parked-msgs", "100", "--throughput-msgs", "50000"]
RING_DRY_ARGS = ["--json", "--latency-msgs", "300", "--parked-msgs", "5", "--throughput-msgs", "2000"]


def _run(cmd: list[str], timeout: float, cwd: Any, env: dict[str, str] | None = None) -> tuple[int | None, str, str]:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout, 1), cwd=cwd,
                              env=None if env is None else {**os.environ, **env})
    except subprocess.TimeoutExpired as e:
        return None, (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timed out"
    return done.returncode, done.stdout, done.stderr


def _ring(ctx: Context, deadline: float, args: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, str(ctx.repo / "scripts" / "bench_ring.py"), *args]
    code, out, err = _run(cmd, deadline - time.monotonic(), ctx.repo)
    if code != 0:
        return {"error": f"exit {code}", "stderr_tail": err[-2000:]}
    return json.loads(out.strip().splitlines()[-1])


def ring(ctx: Context, deadline: float) -> dict[str, Any]:
    return _ring(ctx, deadline, RING_ARGS)


def ring_dry(ctx: Context, deadline: float) -> dict[str, Any]:
    return {"toy_run": _ring(ctx, deadline, RING_DRY_ARGS), "device_args": RING_ARGS}


def _gemm_lanes(ctx: Context, deadline: float, extra: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    runs = [("lane", "lane", {}), ("main", "main", {}),  # prefill on the remainder, then on its own group:
            ("lane_structured_prefill", "lane", {"AGENTSERVE_GREEN_PREFILL": "structured"})]
    for i, (key, thread, env) in enumerate(runs):
        cmd = [sys.executable, str(ctx.repo / "scripts" / "gpu_gemm_lanes.py"), "--thread", thread, *extra]
        code, stdout, err = _run(cmd, (deadline - time.monotonic()) / (len(runs) - i), ctx.repo, env)
        out[key] = {"exit_code": code, "lines": _json_lines(stdout)}
        if code != 0:
            out[key]["stderr_tail"] = err[-2000:]
    return out


def _json_lines(text: str) -> list[Any]:
    """Every line of ``text`` that parses as JSON (a child cut short may end mid-line, or print other things)."""
    lines = []
    for line in text.splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            continue
    return lines


def gemm_lanes(ctx: Context, deadline: float) -> dict[str, Any]:
    return _gemm_lanes(ctx, deadline, [])


def gemm_lanes_dry(ctx: Context, deadline: float) -> dict[str, Any]:
    return _gemm_lanes(ctx, deadline, ["--dry-run"])


def _pytest(ctx: Context, deadline: float, extra: list[str], log_name: str) -> dict[str, Any]:
    # test modules that import what the device image lacks (the test extra: openai, langchain...) fail to
    # collect there; the GPU tests still run
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests", "-q", "-p", "no:cacheprovider",
           "--continue-on-collection-errors", *extra]
    code, out, err = _run(cmd, deadline - time.monotonic(), ctx.repo)
    (ctx.out / log_name).write_text(out + err)
    tail = [line for line in (out + err).splitlines() if line.strip()][-3:]
    return {"exit_code": code, "summary": tail, "log": log_name}


def pytest_gpu(ctx: Context, deadline: float) -> dict[str, Any]:
    return _pytest(ctx, deadline, ["-rs"], "pytest_gpu.txt")


def pytest_gpu_dry(ctx: Context, deadline: float) -> dict[str, Any]:
    return _pytest(ctx, deadline, ["--collect-only"], "pytest_gpu_collect.txt")
