"""Per-step GPU time: carried by Result (default -1 when not measured), measured from CUDA events on GPU."""

from __future__ import annotations

import pytest
import torch

from agentserve.executor.step_timing import timed_step
from agentserve.protocol.lanes import Lane
from agentserve.protocol.ring_messages import Result, from_executor_codec


def test_result_carries_gpu_time_and_defaults_to_unmeasured():
    codec = from_executor_codec()
    old_style = Result(3, Lane.DECODE, 1, [], 1.0, 2.0, 0.5)
    assert codec.decode(codec.encode(old_style)).gpu_ms == -1.0
    assert codec.decode(codec.encode(Result(3, Lane.DECODE, 1, [], 1.0, 2.0, 0.5, 1.25))).gpu_ms == 1.25


def test_no_stream_no_measurement():
    with timed_step(None, "decode rung 0 batch 1 tokens 1") as clock:
        pass
    assert clock.gpu_ms == -1.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_time_of_a_step():
    stream = torch.cuda.Stream()
    a = torch.randn(2048, 2048, device="cuda")
    with torch.cuda.stream(stream), timed_step(stream, "prefill rung 0 batch 1 tokens 2048") as clock:
        for _ in range(10):
            a = a @ a / 2048
    assert clock.gpu_ms > 0
