"""Splitting the device's SMs for one rung, as the driver really allows it.

``cuDevSmResourceSplitByCount`` guarantees disjoint, symmetrical groups, and may form *fewer* groups than
``total / minCount`` because of cluster rules (on one H100, 8-SM clusters covered only 120 of 132 SMs); a
group it cannot form at all comes back as ``CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION`` (915) or as zero
groups.  It may also round a group up.  So a rung is planned in two steps: ask for ``d`` SMs, and if the
driver cannot form them, ask again ``align`` SMs smaller, down to the legal minimum; the sizes that come
back are the rung's real sizes.  Rungs whose real sizes coincide are merged by the caller.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from agentserve.executor.partition.driver import CudaCallError, call
from agentserve.executor.partition.ladder import Granularity, legal_range

log = logging.getLogger(__name__)
CANNOT_FORM = (914, 915)  # CUDA_ERROR_INVALID_RESOURCE_TYPE / _CONFIGURATION: this split is not possible


@dataclass
class RungSplit:
    """One split's two disjoint halves: the decode group and the prefill group (or remainder)."""

    asked: int
    decode: Any
    prefill: Any
    decode_sms: int
    prefill_sms: int
    structured: bool = False  # prefill is a structured group of its own, not the remainder


def _one_split(drv: Any, resource: Any, decode_sms: int, total: int, gran: Granularity,
               structured: bool) -> tuple[Any, Any, bool]:
    """The decode group of (at least) ``decode_sms`` SMs, the prefill side, and whether that is a structured
    group, from one split call.

    Prefill runs on the split's remainder — unless ``structured`` (``AGENTSERVE_GREEN_PREFILL=structured``,
    :mod:`.green_ctx`) and the driver has ``cuDevSmResourceSplit`` (CUDA 13): then both are structured groups,
    prefill getting the rest rounded down to the alignment (the few SMs left over idle).  A remainder is
    "unstructured", with no co-scheduling guarantee (the driver API notes); on an H200 small bf16 products
    failed (``CUBLAS_STATUS_EXECUTION_FAILED``) on the one 12-SM remainder, which the executor's warm-up then
    drops.  Driver 580 (CUDA 13.0) lacks ``cuDevSmResourceSplit``, so there this option keeps the remainder."""
    prefill_sms = (total - decode_sms) // gran.align * gran.align
    if structured and getattr(drv, "cuDevSmResourceSplit", None) is not None and prefill_sms >= gran.min_size:
        try:
            return (*_structured_pair(drv, resource, decode_sms, prefill_sms), True)
        except CudaCallError as e:
            if getattr(drv, "cuDevSmResourceSplitByCount", None) is None:
                raise
            log.warning("no structured prefill group of %d SMs beside %d (%s): prefill takes the remainder",
                        prefill_sms, decode_sms, e)
    if getattr(drv, "cuDevSmResourceSplitByCount", None) is not None:
        results, groups, remaining = call(drv, "cuDevSmResourceSplitByCount", 1, resource, 0, decode_sms)
        if int(groups) < 1 or not results:
            raise CudaCallError("cuDevSmResourceSplitByCount", f"formed no group of {decode_sms} SMs", 915)
        return results[0], remaining, False
    params = drv.CU_DEV_SM_RESOURCE_GROUP_PARAMS()
    params.smCount = decode_sms
    out = call(drv, "cuDevSmResourceSplit", 1, resource, 0, [params])
    return out[0][0], out[-1], False


def _structured_pair(drv: Any, resource: Any, decode_sms: int, prefill_sms: int) -> tuple[Any, Any]:
    params = []
    for count in (decode_sms, prefill_sms):
        p = drv.CU_DEV_SM_RESOURCE_GROUP_PARAMS()
        p.smCount = count
        params.append(p)
    groups = call(drv, "cuDevSmResourceSplit", 2, resource, 0, params)[0]
    if not groups or len(groups) < 2:
        raise CudaCallError("cuDevSmResourceSplit", f"formed no groups of {decode_sms} and {prefill_sms} SMs", 915)
    return groups[0], groups[1]


def split_rung(drv: Any, resource: Any, asked: int, total: int, gran: Granularity,
               structured: bool = False) -> tuple[RungSplit | None, str]:
    """The split for a rung that asks ``asked`` decode SMs, shrunk until the driver forms it; and a note.

    ``None`` when no legal size at or below ``asked`` can be formed.  Errors other than "cannot form"
    are raised: they are failures of the driver, not of this size."""
    bounds = legal_range(total, gran)
    lo = bounds[0] if bounds else asked
    last = ""
    size = asked
    while size >= lo:
        try:
            decode, prefill, paired = _one_split(drv, resource, size, total, gran, structured)
        except CudaCallError as e:
            if e.code not in CANNOT_FORM:
                raise
            last = str(e)
            size -= gran.align
            continue
        got_d, got_p = int(decode.sm.smCount), int(prefill.sm.smCount)
        if got_d >= 1 and got_p >= gran.min_size and got_d + got_p <= total:
            note = "" if got_d == asked else f"asked {asked} SMs, the driver formed {got_d}"
            if structured and not paired:
                note = "; ".join(n for n in (note, f"{got_d} SMs: prefill on the remainder") if n)
            return RungSplit(asked, decode, prefill, got_d, got_p, paired), note
        last = f"a group of {size} SMs left {got_d}+{got_p} of {total}"
        size -= gran.align
    return None, f"asked {asked} SMs: no split formed ({last})"
