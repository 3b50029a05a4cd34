"""Decode step time (inter-token latency) alone, time-sliced with a 4k-token prefill, and partitioned.

    python scripts/bench_lanes.py --model bench --json

Prints p50/p95 of the decode step time for: decode alone on the whole device; decode alone on its
partition; decode and prefill chunks time-sliced on one lane (whole device); decode on its
partition while the prefill runs on the other lane (``partitioned``); and decode on the shared top
rung while the prefill lane runs there too at low priority (``shared_low_priority``: SCHED_IDLE on
CPU, the low-priority stream on a GPU).  Targets (issue 5): prefill on the other lane keeps decode
p95 ≤ 1.5× alone, and time-sliced p95 ≥ 2× that.  Measure, do not assume: timings on a shared box
are noisy, so the JSON carries every figure the ratios come from.
"""

from __future__ import annotations

import argparse
import json

from lane_check import alone_gaps, common_args, header, partitioned, ratio, setup, summary, time_sliced, warm_up


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
        # alone is measured before and after the loaded modes (half the steps each): the box drifts
        half = max(1, args.steps // 2)
        whole, part = alone_gaps(backend, wl, top, half), alone_gaps(backend, wl, rung, half)
        loaded = {
            "time_sliced": time_sliced(backend, wl, top),
            "partitioned": partitioned(backend, wl, rung),
            "shared_low_priority": partitioned(backend, wl, top),
        }
        whole += alone_gaps(backend, wl, top, half)
        part += alone_gaps(backend, wl, rung, half)
        figures = {"alone": summary(whole), "alone_on_partition": summary(part), **loaded}
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
            "shared_low_priority_over_alone": ratio(figures["shared_low_priority"], figures["alone"]),
            "time_sliced_over_shared_low_priority": ratio(figures["time_sliced"], figures["shared_low_priority"]),
        },
    }
    ratios = out["ratios_p95"]
    out["targets"] = {
        f"{mode}: p95 <= 1.5x alone and time-sliced >= 2x": bool(
            ratios[f"{mode}_over_alone"]
            and ratios[f"{mode}_over_alone"] <= 1.5
            and ratios[f"time_sliced_over_{mode}"]
            and ratios[f"time_sliced_over_{mode}"] >= 2.0
        )
        for mode in ("partitioned", "shared_low_priority")
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
