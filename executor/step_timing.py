"""GPU time and an NVTX range around one lane step on CUDA (nothing on a CPU).

The range is named ``<lane> rung <r> batch <n> tokens <t>`` so a profiler timeline shows which step ran
where.  The GPU time is taken between two CUDA events recorded on the lane's stream before and after the
step; a step ends by reading its results back (a host sync), so the end event is complete, or nearly, when
it is read.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass
class StepClock:
    gpu_ms: float = -1.0  # -1: not measured


@contextmanager
def timed_step(stream: Any, label: str) -> Iterator[StepClock]:
    """Measure the work enqueued on ``stream`` (a torch CUDA stream, or None: no measurement) while inside."""
    clock = StepClock()
    if stream is None:
        yield clock
        return
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.nvtx.range_push(label)
    start.record(stream)
    try:
        yield clock
    finally:
        end.record(stream)
        torch.cuda.nvtx.range_pop()
    end.synchronize()
    clock.gpu_ms = start.elapsed_time(end)
