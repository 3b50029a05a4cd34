"""Partition-ladder arithmetic: which decode/prefill splits a device allows.

Pure functions, no hardware.  A *unit* is an SM on a GPU and a core on a CPU.  The ladder is a
list of rungs ordered by growing decode share; every partitioned rung gives decode ``d`` units and
prefill the other ``total - d``, both at least ``min_size``, ``d`` a multiple of ``align``.  The last
rung is always the whole device for both lanes, unpartitioned (on a GPU: a plain stream).

Snapping: each target share ``p`` gives ``d = round(p * total / align) * align``, raised to the
smallest legal size and capped at the largest; duplicates are dropped, so a small device has
fewer rungs than targets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from agentserve.protocol.lanes import Rung

DEFAULT_SHARES: tuple[float, ...] = tuple(p / 10 for p in range(1, 11))  # 10 % … 100 %


@dataclass(frozen=True)
class Granularity:
    """Legal partition sizes: at least ``min_size`` units, a multiple of ``align``.

    ``source`` says where the numbers came from (``"driver"``: read from the SM resource;
    ``"compute-capability"``: the documented fallback table; ``"cpu"``: one core).
    """

    min_size: int
    align: int
    source: str = "driver"

    def __post_init__(self) -> None:
        if self.min_size < 1 or self.align < 1:
            raise ValueError(f"granularity must be positive, got min {self.min_size} align {self.align}")


CPU_GRANULARITY = Granularity(1, 1, "cpu")


def granularity_from_cc(major: int, minor: int) -> Granularity:
    """Documented fallback when the driver's SM resource lacks the granularity fields.

    From the CUDA driver API notes of ``cuDevSmResourceSplitByCount`` (12.4–12.9): CC 6.x min 1;
    CC 7.x min 2, multiple of 2; CC 8.x min 4, multiple of 2; CC 9.0 and newer min 8, multiple of 8.
    Only used when ``minSmPartitionSize`` / ``smCoscheduledAlignment`` cannot be read.
    """
    if major >= 9:
        return Granularity(8, 8, "compute-capability")
    if major == 8:
        return Granularity(4, 2, "compute-capability")
    if major == 7:
        return Granularity(2, 2, "compute-capability")
    return Granularity(1, 1, "compute-capability")


def legal_range(total: int, gran: Granularity) -> tuple[int, int] | None:
    """The smallest and largest legal decode size, or ``None`` when no split is possible."""
    lo = math.ceil(gran.min_size / gran.align) * gran.align
    hi = ((total - gran.min_size) // gran.align) * gran.align
    return (lo, hi) if lo <= hi else None


def snap(target: float, total: int, gran: Granularity) -> int | None:
    """Decode units for a target share of ``total``: nearest multiple of ``align`` inside the legal range."""
    bounds = legal_range(total, gran)
    if bounds is None:
        return None
    lo, hi = bounds
    d = math.floor(target * total / gran.align + 0.5) * gran.align  # half up, not banker's
    return min(max(d, lo), hi)


def build_ladder(total: int, gran: Granularity, shares: tuple[float, ...] = DEFAULT_SHARES) -> list[Rung]:
    """Rungs for ``shares`` (each in (0, 1]); a share of 1.0 or more is the unpartitioned top rung."""
    if total < 1:
        raise ValueError(f"total units must be >= 1, got {total}")
    sizes: list[int] = []
    for share in sorted(shares):
        if not share > 0.0:
            raise ValueError(f"shares must be > 0, got {share}")
        if share >= 1.0:
            continue
        d = snap(share, total, gran)
        if d is not None and d not in sizes:
            sizes.append(d)
    rungs = [Rung(index=i, decode_units=d, prefill_units=total - d, partitioned=True) for i, d in enumerate(sizes)]
    rungs.append(Rung(index=len(rungs), decode_units=total, prefill_units=total, partitioned=False))
    return rungs


def rung_for_decode_units(ladder: list[Rung], wanted: int) -> Rung:
    """The smallest rung giving decode at least ``wanted`` units (the top rung when none does)."""
    for rung in ladder:
        if rung.decode_units >= wanted:
            return rung
    return ladder[-1]
