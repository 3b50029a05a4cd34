"""Which matrix products run on each lane's stream, per rung: bf16 / fp32, with and without a bias, 1 to 8192 rows.

Seen on an H200 (driver 580.159, torch 2.11.0+cu130): the executor's warm-up — a 3-token bf16 prefill of the
built-in Qwen2 models — failed with CUBLAS_STATUS_EXECUTION_FAILED on green contexts, while fp32 and plain
streams (cuda-streams) ran.  This maps where it happens: on that H200, bf16 products of 1-512 rows fail only on
rung 8's prefill side (the 12-SM remainder beside 120 decode SMs), which the warm-up now drops.
One process per call (a failure may leave cuBLAS unusable in it):

  python scripts/gpu_gemm_lanes.py --thread lane|main [--rungs 0,4,8,9] [--dry-run]

``lane``: on a LaneWorker thread bound to the lane, as the executor runs; ``main``: from the main thread on the
lane's stream, as the physics section does.  Prints JSON lines: the backend (and its reason), then per (rung,
lane) as it finishes the cases that failed with their errors and how many ran, then the seconds taken.
``--dry-run``: cpu-cores lanes, fp32 only (any CPU machine).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ROWS = (1, 3, 8, 32, 512, 8192)
OUT_FEATURES, IN_FEATURES = 768, 512  # the bench model's fused q/k/v projection


def products(device: str, dtypes: list[Any]) -> list[tuple[str, Any]]:
    """(name, thunk) per case; each thunk runs one ``F.linear`` and waits for it on the current stream."""
    import torch
    import torch.nn.functional as F

    cases = []
    for dtype in dtypes:
        w = torch.randn(OUT_FEATURES, IN_FEATURES, dtype=dtype, device=device)
        b = torch.randn(OUT_FEATURES, dtype=dtype, device=device)
        for rows in ROWS:
            x = torch.randn(rows, IN_FEATURES, dtype=dtype, device=device)
            for bias in (None, b):
                name = f"{str(dtype).removeprefix('torch.')} rows={rows} bias={bias is not None}"
                cases.append((name, lambda x=x, w=w, bias=bias: _run(F.linear, x, w, bias)))
    return cases


def _run(linear: Any, x: Any, w: Any, bias: Any) -> None:
    import torch

    linear(x, w, bias)
    if x.is_cuda:
        torch.cuda.current_stream(x.device).synchronize()


def run_cases(cases: list[tuple[str, Any]]) -> dict[str, Any]:
    failed = {}
    for name, thunk in cases:
        try:
            thunk()
        except Exception as e:  # noqa: BLE001 - the failure is the answer
            failed[name] = f"{type(e).__name__}: {str(e)[:200]}"
    return {"ran": len(cases), "failed": failed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--thread", choices=("lane", "main"), default="lane")
    ap.add_argument("--rungs", default="0,4,8,9", help="rung indices (the top one is unpartitioned)")
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(REPO / "scripts"))
    from gpu_probe import ensure_agentserve

    ensure_agentserve()
    import torch

    from agentserve.executor.lanes import LaneWorker
    from agentserve.executor.partition import detect
    from agentserve.protocol.lanes import Lane

    backend = detect("cpu-cores" if a.dry_run else None)
    device = "cpu" if a.dry_run else "cuda"
    cases = products(device, [torch.float32] if a.dry_run else [torch.bfloat16, torch.float32])
    if not a.dry_run:
        torch.cuda.synchronize()  # the inputs, made on the default stream, are ready for every lane's stream
    wanted = [int(r) for r in a.rungs.split(",")]
    rungs = [r.index for r in backend.ladder if r.index in wanted] or [backend.ladder[-1].index]
    print(json.dumps({"backend": backend.name, "reason": backend.reason, "thread": a.thread, "rows": list(ROWS)}),
          flush=True)
    t0 = time.perf_counter()
    try:
        for rung in rungs:  # one line per (rung, lane) as it finishes: a run cut short keeps what it measured
            for lane in (Lane.DECODE, Lane.PREFILL):
                if a.thread == "lane":
                    with LaneWorker(backend, lane, rung) as worker:
                        result = worker.submit(lambda binding: run_cases(cases)).result()
                else:
                    with torch.cuda.stream(backend.stream_for(lane, rung)) if not a.dry_run else _nothing():
                        result = run_cases(cases)
                r = backend.ladder[rung]
                sms = r.decode_units if lane == Lane.DECODE else r.prefill_units
                print(json.dumps({"rung": rung, "lane": lane.name, "sms": sms, **result}), flush=True)
    finally:
        print(json.dumps({"seconds": round(time.perf_counter() - t0, 2)}), flush=True)
        backend.close()
    return 0


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
