"""The device probe: one offline run on a GPU box answers what the GPU path needs to know (issue 17).

    python scripts/gpu_probe.py --out DIR            # on the GPU box (scripts/gpu_check.sh runs it)
    python scripts/gpu_probe.py --dry-run --out DIR  # on any CPU machine: every path that needs no GPU

Each section appends one JSON line to ``DIR/probe.jsonl`` (``section``, ``status``, ``seconds``,
``result`` or ``error``) and the run ends with a summary table.  The whole run keeps to ``--budget-s``
(default 380 s, under the 7 minutes one device check may take): sections stop their loops at their own
budget and the global deadline, and say so (``cut_by_budget``).  It imports only what the device image
has plus the wheels in ``scripts/gpu_wheels.txt`` (checked at the end of every run), and finds the
``agentserve`` package without installing it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def ensure_agentserve() -> None:
    """Make ``import agentserve`` work without pip: a symlink ``agentserve`` → the repo on ``sys.path``
    (and on ``PYTHONPATH`` for the child processes)."""
    try:
        import agentserve.executor  # noqa: F401
        return
    except ImportError:
        pass
    shim = Path(tempfile.gettempdir()) / f"agentserve-shim-{os.getuid()}"
    shim.mkdir(exist_ok=True)
    link = shim / "agentserve"
    if not link.is_symlink():
        link.symlink_to(REPO, target_is_directory=True)
    sys.path.insert(0, str(shim))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(shim), os.environ.get("PYTHONPATH", "")) if p)


def sections() -> list:
    from probe import attention, env, memory, model, partitions, physics, subprocs
    from probe.common import Section

    return [
        Section("environment", "what is installed, what the device is, what doctor says", 15,
                env.environment, env.environment),
        Section("sm_resource", "min partition size, alignment, groups each planned rung really gets", 15,
                env.sm_resource, env.sm_resource_dry),
        Section("sm_map", "which SMs each lane's kernels run on, per rung (%smid); overlap", 25,
                partitions.sm_map, partitions.plan_only("distinct SMs per (rung, lane) and their overlap")),
        Section("events_graph", "events and a CUDA graph across streams of different green contexts", 10,
                partitions.events_graph, partitions.plan_only("cross-context event order; graph replay SMs")),
        Section("gemm_lanes", "which bf16/fp32 products (1-8192 rows, bias or not) run on each lane's stream",
                90, subprocs.gemm_lanes, subprocs.gemm_lanes_dry),
        Section("physics", "bf16 GEMM on prefill beside a bandwidth-bound copy on decode, per rung", 35,
                physics.physics, physics.physics_dry),
        Section("model", "1B bf16 decode b32@2k alone / beside 8k prefill / time-sliced; GIL control; switching",
                95, model.model, model.model_dry),
        Section("attention", "decode b1/8/32 at 2k/8k and prefill per backend (torch, triton, flashinfer), "
                "eager vs CUDA graphs", 60, attention.attention, attention.attention_dry),
        Section("memory", "memory peaks: caching allocator vs one shared pool; KV from the profile", 45,
                memory.memory, memory.memory_dry),
        Section("ring", "shared-memory ring vs ZeroMQ with a spinning reader", 25, subprocs.ring, subprocs.ring_dry),
        Section("pytest_gpu", "pytest -m gpu", 55, subprocs.pytest_gpu, subprocs.pytest_gpu_dry),
    ]


def run_section(ctx, section) -> dict:
    from probe.common import write_line

    record = {"section": section.name, "question": section.question, "dry_run": ctx.dry_run}
    t0 = time.monotonic()
    if ctx.left() < 5:
        record |= {"status": "skipped", "error": "probe budget spent"}
    else:
        try:
            fn = section.dry if ctx.dry_run else section.run
            record |= {"status": "ok", "result": fn(ctx, ctx.section_deadline(section.budget_s))}
        except Exception as e:  # noqa: BLE001 - one section's failure is its answer; the others still run
            record |= {"status": "error", "error": f"{type(e).__name__}: {e}",
                       "traceback": traceback.format_exc(limit=6)[-3000:]}
    record["seconds"] = round(time.monotonic() - t0, 2)
    if section.name == "events_graph" and not ctx.dry_run:
        ordered = record.get("result", {}).get("event_across_contexts", {}).get("ordered")
        ctx.found["events_ok"] = bool(ordered)
    write_line(ctx.out / "probe.jsonl", record)
    return record


def summary(records: list[dict]) -> str:
    lines = [f"{'section':<14}{'status':<9}{'seconds':>8}  answer"]
    for r in records:
        brief = r.get("error") or _brief(r.get("result", {}))
        lines.append(f"{r['section']:<14}{r['status']:<9}{r['seconds']:>8.1f}  {brief[:150]}")
    return "\n".join(lines)


def _brief(result: dict) -> str:
    keys = ("backend", "total_sms", "tool", "rungs", "parameters", "native", "exit_code", "summary")
    parts = []
    for key in keys:
        if key in result:
            value = result[key]
            parts.append(f"{key}={len(value)} rows" if isinstance(value, list) and key == "rungs" else f"{key}={value}")
    return "; ".join(parts) or ", ".join(list(result)[:6])


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/agentserve-gpu-probe")))
    ap.add_argument("--dry-run", action="store_true", help="walk every path that needs no GPU (any CPU machine)")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--budget-s", type=float, default=380.0, help="the whole run's time limit")
    ap.add_argument("--only", default="", help="comma-separated section names")
    ap.add_argument("--list", action="store_true", help="list the sections and exit")
    ap.add_argument("--memory-worker", choices=("native", "shared"), help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    ensure_agentserve()
    if args.memory_worker:
        from probe.memory import worker

        return worker(args.device, args.memory_worker, args.out)
    from agentserve.executor.memory import configure_cuda_allocator

    configure_cuda_allocator()  # as the executor does, before CUDA starts
    from probe.common import Context, foreign_imports, write_line

    chosen = [s for s in sections() if not args.only or s.name in args.only.split(",")]
    if args.list:
        print("\n".join(f"{s.name:<14}{s.budget_s:>5.0f}s  {s.question}" for s in chosen))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = Context(out=args.out, dry_run=args.dry_run, deadline=time.monotonic() + args.budget_s, repo=REPO,
                  device=args.device)
    print(f"gpu_probe: {'dry run, ' if args.dry_run else ''}{len(chosen)} sections -> {args.out / 'probe.jsonl'}")
    records = []
    try:
        for section in chosen:
            records.append(run_section(ctx, section))
            print(summary(records[-1:]).splitlines()[-1], flush=True)
    finally:
        if "backend" in ctx.found:
            ctx.found["backend"].close()
    foreign = foreign_imports(REPO)
    write_line(args.out / "probe.jsonl", {"section": "imports", "status": "ok" if not foreign else "error",
                                          "foreign": foreign})
    text = summary(records)
    (args.out / "summary.txt").write_text(text + "\n")
    print("\n" + text)
    if foreign:
        print(f"imports outside the device image and the carried wheels: {foreign}")
    failed = [r["section"] for r in records if r["status"] != "ok"]
    return 1 if foreign or (args.dry_run and failed) else 0


if __name__ == "__main__":
    sys.exit(main())
