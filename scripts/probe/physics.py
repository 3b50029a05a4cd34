"""Section ``physics``: what a partition does to raw work, per rung.

A compute-bound bf16 GEMM on the prefill lane's stream beside a bandwidth-bound copy on the decode lane's
stream, and each alone.  Both are issued from one thread (no GIL in the way) and timed with CUDA events
on their own streams.  Answers: does a rung's decode share keep its bandwidth while prefill computes
(SMs are partitioned, memory bandwidth and L2 are not), and how much GEMM throughput does prefill keep?
"""

from __future__ import annotations

from typing import Any

from probe.common import Budget, Context
from probe.partitions import backend

GEMM_N = 8192
COPY_BYTES = 1 << 31  # 2 GiB, far beyond the 60 MB L2
GEMMS, COPIES = 8, 16


def _timed(stream: Any, work: Any, times: int) -> tuple[Any, Any]:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        for _ in range(times):
            work()
        end.record(stream)
    return start, end


def _rates(events: dict[str, tuple[Any, Any]]) -> dict[str, float]:
    out = {}
    for name, (start, end) in events.items():
        end.synchronize()
        ms = start.elapsed_time(end)
        if name == "gemm":
            out["gemm_tflops"] = round(GEMMS * 2 * GEMM_N**3 / (ms / 1e3) / 1e12, 1)
        else:
            out["copy_gb_s"] = round(COPIES * 2 * COPY_BYTES / (ms / 1e3) / 1e9, 1)
        out[f"{name}_ms"] = round(ms, 3)
    return out


def _one_rung(b: Any, rung: int, a: Any, w: Any, src: Any, dst: Any) -> dict[str, Any]:
    from agentserve.protocol.lanes import Lane

    pre, dec = b.stream_for(Lane.PREFILL, rung), b.stream_for(Lane.DECODE, rung)

    def gemm() -> None:
        a @ w

    def copy() -> None:
        dst.copy_(src)

    alone = {**_rates({"gemm": _timed(pre, gemm, GEMMS)}), **_rates({"copy": _timed(dec, copy, COPIES)})}
    together = _rates({"gemm": _timed(pre, gemm, GEMMS), "copy": _timed(dec, copy, COPIES)})
    r = b.ladder[rung]
    return {"rung": rung, "decode_units": r.decode_units, "prefill_units": r.prefill_units,
            "partitioned": r.partitioned, "alone": alone, "together": together}


def physics(ctx: Context, deadline: float) -> dict[str, Any]:
    import torch

    b = backend(ctx)
    device = torch.device(ctx.device)
    a = torch.randn(GEMM_N, GEMM_N, device=device, dtype=torch.bfloat16)
    w = torch.randn(GEMM_N, GEMM_N, device=device, dtype=torch.bfloat16)
    src = torch.empty(COPY_BYTES // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    torch.cuda.synchronize(device)
    budget, rows = Budget(deadline), []
    for rung in b.ladder:
        if not budget.more():
            break
        rows.append(_one_rung(b, rung.index, a, w, src, dst))
    del a, w, src, dst
    torch.cuda.empty_cache()
    return {"gemm": f"{GEMM_N}^3 bf16 x{GEMMS}", "copy": f"{COPY_BYTES >> 30} GiB x{COPIES}", "rungs": rows,
            "cut_by_budget": budget.cut}


def physics_dry(ctx: Context, deadline: float) -> dict[str, Any]:
    return {"would_measure": "per rung: bf16 GEMM on the prefill stream beside a 2 GiB copy on the decode stream",
            "gemm_tflop_each": round(2 * GEMM_N**3 / 1e12, 2), "copy_gib_each": COPY_BYTES >> 30}
