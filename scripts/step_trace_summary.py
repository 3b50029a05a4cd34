"""Summarise an ``agentserve up --trace-steps`` file: where decode step time goes.

    python scripts/step_trace_summary.py steps.jsonl

Groups decode-lane steps by rung, batch size (sequences, 4+ pooled), whether prefill tokens rode in the
step, and what ran beside it on the prefill lane (nothing / a short prefill / a long one), and prints the
median / p90 / max step time of each group; then the prefill lane's steps by size, and the decode lane's
idle gaps. A TPOT figure is mostly these step times: this shows which kind of step sets it.

Then where a first token's time goes (traces that list each step's ``prefills``): for the steps that sample
a prompt's token, grouped by class (cold / resume), lane, and whether the step ran inside another of its lane
(a preempting step inside a cold chunk), the median / p90 of the time from the turn's arrival to the step's
planning (``queued``: waiting, and for a chunked prompt its earlier chunks), from planning to the step's start
(``to start``: the ring, the lane finishing what it ran, the wait for cores), the step itself (``run``), and
their sum (``TTFT``, in the server: the client adds its socket and detokenising).
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
from collections import defaultdict

LONG_PREFILL = 256  # prefill tokens from which a step beside decode counts as a long (cold-sized) one


def quantile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default, as ``agentserve bench`` reports)."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def beside(step: dict, prefill_steps: list[dict], starts: list[float]) -> str:
    """What the prefill lane ran while ``step`` ran: none, short or long (by its prefill tokens).

    ``prefill_steps`` are sorted by start (``starts``).  One lane's steps overlap only where a preempting step
    ran inside another (the one just before it), so the walk back from the last one starting before ``step``
    ends stops at the first that ended before it and is not inside the one before it."""
    over: list[dict] = []
    for i in range(bisect.bisect_left(starts, step["end"]) - 1, -1, -1):
        p = prefill_steps[i]
        if p["end"] > step["start"]:
            over.append(p)
        elif not (i > 0 and prefill_steps[i - 1]["end"] >= p["end"]):
            break
    if not over:
        return "none"
    return "long" if max(p["prefill_tokens"] for p in over) >= LONG_PREFILL else "short"


def summarise(steps: list[dict]) -> list[str]:
    decode = [s for s in steps if s["lane"] == "decode" and s["decode_seqs"]]
    prefill = sorted((s for s in steps if s["lane"] == "prefill"), key=lambda s: s["start"])
    starts = [s["start"] for s in prefill]
    groups: dict[tuple, list[float]] = defaultdict(list)
    for s in decode:
        mixed = "+prefill" if s["prefill_tokens"] else "-"
        key = (s["rung"], min(s["decode_seqs"], 4), mixed, beside(s, prefill, starts))
        groups[key].append(s["ms"])
    out = [f"{'rung':>4} {'seqs':>4} {'mixed':>8} {'beside':>6} {'steps':>6} {'median':>8} {'p90':>8} {'max':>8}"]
    for (rung, seqs, mixed, near), ms in sorted(groups.items()):
        out.append(f"{rung:>4} {seqs:>4} {mixed:>8} {near:>6} {len(ms):>6} {statistics.median(ms):>8.1f} "
                   f"{quantile(ms, 0.9):>8.1f} {max(ms):>8.1f}")
    for label, part in (("short", [s for s in prefill if s["prefill_tokens"] < LONG_PREFILL]),
                        ("long", [s for s in prefill if s["prefill_tokens"] >= LONG_PREFILL])):
        if part:
            ms = [s["ms"] for s in part]
            out.append(f"prefill lane, {label} steps: {len(ms)}, median {statistics.median(ms):.0f} ms, "
                       f"p90 {quantile(ms, 0.9):.0f} ms")
    gaps = [s["gap_ms"] for s in steps if s["lane"] == "decode"]
    if gaps:
        out.append(f"decode lane idle before a step: median {statistics.median(gaps):.1f} ms, "
                   f"p99 {quantile(gaps, 0.99):.1f} ms, max {max(gaps):.0f} ms")
    return out


def first_tokens(steps: list[dict]) -> list[str]:
    """Where the time to each sampled prompt token goes, by class, lane and nesting (see the module docstring)."""
    by_lane: dict[str, list[dict]] = defaultdict(list)
    for s in steps:
        by_lane[s["lane"]].append(s)
    groups: dict[tuple, list[tuple[float, float, float]]] = defaultdict(list)
    for lane, own in by_lane.items():
        own.sort(key=lambda s: s["start"])
        for i, s in enumerate(own):
            nested = "inside" if i and own[i - 1]["end"] > s["start"] else "-"
            for p in s.get("prefills", ()):
                if p["samples"] and "planned" in s:
                    parts = (s["planned"] - p["arrival"], s["start"] - s["planned"], s["end"] - s["start"])
                    groups[(p["phase"], lane, nested)].append(tuple(1e3 * x for x in parts))
    if not groups:
        return []
    out = [f"{'class':>6} {'lane':>7} {'nested':>6} {'turns':>5}   median / p90 ms: "
           f"{'queued':>13} {'to start':>13} {'run':>13} {'TTFT':>13}"]
    for (phase, lane, nested), rows in sorted(groups.items()):
        cols = [[r[k] for r in rows] for k in range(3)] + [[sum(r) for r in rows]]
        figures = " ".join(f"{statistics.median(c):>6.1f}/{quantile(c, 0.9):>6.1f}" for c in cols)
        out.append(f"{phase:>6} {lane:>7} {nested:>6} {len(rows):>5}   {'':>16}{figures}")
    return out


def read_trace(path: str) -> list[dict]:
    """The trace's records; ``ValueError`` naming the line for one that is not a JSON object.  A last line cut short
    (a trace still being written, or its server killed mid-line) is left out."""
    with open(path, encoding="utf-8") as f:
        lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    steps = []
    for i, (n, line) in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) - 1 and not line.endswith("\n"):
                break
            raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{n}: not a step record (a JSON {type(record).__name__})")
        steps.append(record)
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="a file written by agentserve up --trace-steps")
    ap.add_argument("--policy", help="only the steps of servers running this policy (a bench's servers may share "
                                     "one trace file)")
    args = ap.parse_args()
    try:
        steps = read_trace(args.trace)
        if args.policy:
            steps = [s for s in steps if s.get("policy", {}).get("policy") == args.policy]
        lines = summarise(steps) + first_tokens(steps) if steps else ["no steps in the trace"]
    except (OSError, UnicodeDecodeError, ValueError) as e:
        ap.exit(2, f"{ap.prog}: {e}\n")
    except (KeyError, TypeError) as e:
        ap.exit(2, f"{ap.prog}: {args.trace} is not a step trace of this version (a record without {e})\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
