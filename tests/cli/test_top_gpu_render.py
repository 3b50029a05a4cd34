"""`top`'s dashboard for a server on a GPU, rendered from the snapshot shape such a server publishes (no GPU needed).

On the H200 the e2e check of this dashboard failed with a repr that showed three lines: that was pytest eliding the
middle of the frame, which was whole; it failed on its "cpu-cores" (the backend there is green-ctx).  What is
GPU-only in the frame is the backend's reason: green-ctx gives a long one, and green contexts that fail their
warm-up give way to cuda-streams with the CUDA error's text in it, several lines long (torch's messages are)."""

from __future__ import annotations

import os

import pytest
from rich.console import Console

from agentserve.cli.top_view import render
from agentserve.protocol.lanes import backend_unit
from agentserve.protocol.stats import (
    Control,
    Kv,
    LaneStat,
    Latency,
    Partition,
    Server,
    SessionRow,
    Snapshot,
    decode_snapshot,
    encode_snapshot,
)

GREEN_REASON = ("CUDA Green Contexts (driver CUDA 12.8): 132 SMs, min 8 SMs, alignment 8 (queried); 9 partitioned "
                "rungs, one split each, verified with cuGreenCtxGetDevResource; streams from cuGreenCtxStreamCreate; "
                "top rung = plain streams; asked 12 SMs: same as another rung, dropped")
# executor.process.streams_after_failed_warm_up puts str() of the warm-up's exception in the reason
FELL_BACK_REASON = ("green-ctx failed its warm-up (CUDA error: an illegal memory access was encountered\n"
                    "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace "
                    "below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
                    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n); "
                    "cuda-streams: two CUDA streams (decode priority -1, prefill 0); not partitioned")


# executor.process.Executor.warm drops a rung whose warm-up failed and puts it first in the reason (drop_rungs)
DROPPED_REASON = ("rungs 8 (120/12 SMs) left out: their warm-up failed (warming rung 8, PREFILL: RuntimeError: CUDA "
                  "error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx( handle, ...)`); " + GREEN_REASON)


def gpu_snapshot(backend: str, reason: str, sessions: int) -> bytes:
    """What a server on an H200 publishes: a ladder of 10 rungs, decode on rung 2 of 9 (cuda-streams: one shared
    rung), ``sessions`` agents named watch0.. after a turn each; encoded, as the board and GetStats carry it."""
    partitioned = backend == "green-ctx"
    snap = Snapshot(
        seq=130,
        server=Server(pid=2266, endpoint="ipc:///tmp/pytest-of-root/pytest-0/test_up0/agentserve.sock", run="t",
                      model="/models/tiny-v1", device="cuda:0 NVIDIA H200", uptime_s=13.0),
        partition=Partition(rung=2 if partitioned else 0, num_rungs=10 if partitioned else 1,
                            decode_units=40 if partitioned else 132, prefill_units=92 if partitioned else 132,
                            total_units=132, unit=backend_unit(backend), partitioned=partitioned, backend=backend,
                            reason=reason),
        control=Control(policy="agentserve", b_prefill=512, r_min=2, adjustments=1),
        tpot=Latency(p50_ms=0.8, p95_ms=1.1, slo_ms=50.0, history_ms=[0.8, 0.9]),
        ttft=Latency(p50_ms=1.5, p95_ms=2.0, slo_ms=500.0, history_ms=[1.5, 1.7]),
        kv=Kv(used_blocks=12, total_blocks=512, block_size=16),
        lanes=[LaneStat(name="decode", utilisation=0.02, tokens_per_s=1.2), LaneStat(name="prefill", utilisation=0.01)],
        sessions=[SessionRow(id=i + 1, name=f"watch{i}", turn=1, context_tokens=30, turn_tokens=3, last_ttft_ms=1.5,
                             last_tpot_ms=0.8) for i in range(sessions)],
        sessions_total=sessions,
        turns_done=sessions,
        tokens_out=3 * sessions,
    )
    return encode_snapshot(snap)


def frame(data: bytes, width: int, height: int) -> list[str]:
    """The dashboard as the e2e test and `top --once` print it."""
    with open(os.devnull, "w") as sink:
        console = Console(record=True, width=width, height=height, color_system=None, file=sink)
        console.print(render(decode_snapshot(data), width, height))
    return console.export_text().splitlines()


@pytest.mark.parametrize("width", [80, 200])
@pytest.mark.parametrize(("backend", "reason"), [("green-ctx", GREEN_REASON), ("cuda-streams", FELL_BACK_REASON)])
def test_gpu_snapshot_shows_header_backend_and_sessions(backend: str, reason: str, width: int) -> None:
    lines = frame(gpu_snapshot(backend, reason, 4), width, 24)
    text = "\n".join(lines)
    assert lines[0].startswith("AgentServe  tiny-v1"), text
    assert any(ln.startswith("rung") and "decode" in ln for ln in lines), text
    assert all(f"watch{i}" in text for i in range(4)) and backend in text, text
    assert len(lines) <= 24 and max(map(len, lines)) <= width, text


@pytest.mark.parametrize("width", [80, 200])
@pytest.mark.parametrize(("backend", "reason"), [("green-ctx", GREEN_REASON), ("cuda-streams", FELL_BACK_REASON)])
def test_gpu_reason_is_one_line_so_a_full_frame_fits_its_rows(backend: str, reason: str, width: int) -> None:
    """With more agents than rows the table fills its budget; a reason over several lines pushed the frame past
    24 rows (a live `top` loses its last rows, the '+N more' among them)."""
    lines = frame(gpu_snapshot(backend, reason, 30), width, 24)
    text = "\n".join(lines)
    assert len(lines) <= 24, text
    at = next(i for i, ln in enumerate(lines) if ln.startswith(f"backend {backend}"))
    assert lines[at + 1].startswith("control"), text  # the reason took the backend's line only
    assert "watch0" in text and "more" in lines[-2], text


def test_a_dropped_rung_shows_in_the_backend_line_at_80_columns() -> None:
    """The rung a failed warm-up dropped is the first thing the backend's line says, before the cut."""
    lines = frame(gpu_snapshot("green-ctx", DROPPED_REASON, 4), 80, 24)
    backend = next(ln for ln in lines if ln.startswith("backend green-ctx"))
    assert "rungs 8 (120/12 SMs) left out" in backend, "\n".join(lines)
