"""Decode step time (inter-token latency) alone, time-sliced with a 4k-token prefill, and partitioned.

    python scripts/bench_lanes.py --model bench --json

Prints p50/p95 of the decode step time for: decode alone on the whole device; decode alone on its
partition; decode and prefill chunks time-sliced on one lane (whole device); decode on its
partition while the prefill runs on the other lane.  Targets (issue 5): partitioned p95 ≤ 1.5×
alone, and time-sliced p95 ≥ 2× partitioned.  Measure, do not assume: timings on a shared box
are noisy, so the JSON carries every figure the ratios come from.
"""

from __future__ import annotations

import argparse
import json

from lane_check import alone, common_args, header, partitioned, ratio, setup, time_sliced, warm_up


def pick_rung(backend, wanted: int | None) -> int:
    """The partitioned rung nearest half the device unless one is named."""
    split = [r for r in backend.ladder if r.partitioned]
    if wanted is not None:
        return backend.rung(wanted).index
    if not split:
        return backend.ladder[-1].index
    return split[(len(split) - 1) // 2].index


def main() -> None:
    parser = argparse.ArgumentParser(description="decode step time: alone / time-sliced / partitioned")
    common_args(parser)
    parser.add_argument("--rung", type=int, default=None, help="partitioned rung (default: nearest 50%%)")
    args = parser.parse_args()
    backend, wl = setup(args)
    try:
        top, rung = backend.ladder[-1].index, pick_rung(backend, args.rung)
        warm_up(backend, wl, top)
        figures = {
            "alone": alone(backend, wl, top, args.steps),
            "alone_on_partition": alone(backend, wl, rung, args.steps),
            "time_sliced": time_sliced(backend, wl, top),
            "partitioned": partitioned(backend, wl, rung),
        }
    finally:
        backend.close()
    r = backend.ladder[rung]
    out = {
        **header(backend, wl, args),
        "rung": {"index": r.index, "decode": r.decode_units, "prefill": r.prefill_units},
        **figures,
        "ratios_p95": {
            "partitioned_over_alone": ratio(figures["partitioned"], figures["alone"]),
            "partitioned_over_alone_on_partition": ratio(figures["partitioned"], figures["alone_on_partition"]),
            "time_sliced_over_partitioned": ratio(figures["time_sliced"], figures["partitioned"]),
        },
    }
    ratios = out["ratios_p95"]
    out["targets"] = {
        "partitioned_p95_le_1.5x_alone": bool(
            ratios["partitioned_over_alone"] and ratios["partitioned_over_alone"] <= 1.5
        ),
        "time_sliced_p95_ge_2x_partitioned": bool(
            ratios["time_sliced_over_partitioned"] and ratios["time_sliced_over_partitioned"] >= 2.0
        ),
    }
    if args.json:
        print(json.dumps(out))
        return
    for name in figures:
        f = figures[name]
        print(f"{name:<20} p50 {f.get('p50_ms', '-'):>9} ms  p95 {f.get('p95_ms', '-'):>9} ms  n={f['n']}")
    print(json.dumps(out["ratios_p95"]), json.dumps(out["targets"]))


if __name__ == "__main__":
    main()
