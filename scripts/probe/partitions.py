"""Sections ``sm_map`` (which SMs each lane's kernels run on, per rung) and ``events_graph`` (events and a
CUDA graph across streams of different green contexts), plus the backend the GPU sections share."""

from __future__ import annotations

import time
from typing import Any

from probe.common import Budget, Context
from probe.smid import smid_launcher, sms_used

SPIN_NS = 20_000  # each block holds its SM 20 µs: long enough for the blocks to spread over every SM


def backend(ctx: Context) -> Any:
    """The partition backend the GPU sections share (detected once, closed by the probe at the end)."""
    if "backend" not in ctx.found:
        from agentserve.executor.memory import keep_lanes_independent
        from agentserve.executor.partition import detect
        from agentserve.executor.partition.torch_cuda import TorchCuda, device_index

        index = device_index(ctx.device)
        ctx.found["backend"] = detect(cuda=TorchCuda(index))
        ctx.found["pool"] = keep_lanes_independent(index)
    return ctx.found["backend"]


def _lane_sms(b: Any, launch: Any, rung: int, lane: Any, blocks: int, device: Any) -> tuple[set[int], float]:
    """SM ids of one launch on ``lane``'s stream of ``rung``, and that launch's wall time (first use is slow)."""
    with b.lane_context(lane, rung):
        t0 = time.perf_counter()
        used = sms_used(launch, blocks, SPIN_NS, device)
        return used, time.perf_counter() - t0


def sm_map(ctx: Context, deadline: float) -> dict[str, Any]:
    """Per rung and lane: distinct SMs used vs the ladder's count, overlap between the lanes, first-use cost."""
    import torch

    from agentserve.protocol.lanes import Lane

    b = backend(ctx)
    launch, tool = smid_launcher()
    device = torch.device(ctx.device)
    total = torch.cuda.get_device_properties(device).multi_processor_count
    blocks = 8 * total
    budget, rows = Budget(deadline), []
    for rung in b.ladder:
        if not budget.more():
            break
        row: dict[str, Any] = {"rung": rung.index, "decode_units": rung.decode_units,
                               "prefill_units": rung.prefill_units, "partitioned": rung.partitioned}
        seen = {}
        for lane in Lane:
            first, t_first = _lane_sms(b, launch, rung.index, lane, blocks, device)
            again, t_again = _lane_sms(b, launch, rung.index, lane, blocks, device)
            seen[lane] = first | again
            row[lane.name.lower()] = {"distinct_sms": len(seen[lane]), "first_launch_ms": round(t_first * 1e3, 2),
                                      "second_launch_ms": round(t_again * 1e3, 2)}
        row["overlap_sms"] = len(seen[Lane.DECODE] & seen[Lane.PREFILL])
        rows.append(row)
    ctx.found["sm_sets"] = True
    return {"tool": tool, "backend": b.name, "reason": b.reason, "pool": ctx.found.get("pool"), "blocks": blocks,
            "spin_us": SPIN_NS / 1e3, "rungs": rows, "cut_by_budget": budget.cut}


def _ordered_across(b: Any, first: Any, second: Any, device: Any) -> dict[str, Any]:
    """Write on ``first``'s stream after a slow kernel, record an event; ``second`` waits on it and reads."""
    import torch

    from agentserve.protocol.lanes import Lane

    x = torch.zeros(1 << 24, device=device)
    torch.cuda.synchronize(device)  # made on the default stream, which the lane streams do not wait for
    with b.lane_context(Lane.DECODE, first) as a:
        torch.cuda._sleep(50_000_000)  # ~tens of ms of GPU time before the write
        x.fill_(7.0)
        done = torch.cuda.Event(enable_timing=True)
        done.record(a.stream)
    with b.lane_context(Lane.PREFILL, second) as p:
        p.stream.wait_event(done)
        total = x.sum()
        after = torch.cuda.Event(enable_timing=True)
        after.record(p.stream)
    after.synchronize()
    return {"ordered": bool(total.item() == 7.0 * x.numel()), "gap_ms": round(done.elapsed_time(after), 3)}


def _graph_partition(b: Any, launch: Any, capture_rung: int, device: Any, blocks: int) -> dict[str, Any]:
    """Capture the smid kernel on one rung's decode stream; replay it on other streams; which SMs run it?"""
    import torch

    from agentserve.protocol.lanes import Lane

    out = torch.full((blocks,), -1, dtype=torch.int32, device=device)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with b.lane_context(Lane.DECODE, capture_rung) as a:
        launch(out, SPIN_NS)  # compiled and loaded outside the capture
        a.stream.synchronize()
        with torch.cuda.graph(graph, stream=a.stream):
            launch(out, SPIN_NS)
    replays = {}
    top = b.ladder[-1].index
    for name, (lane, rung) in {"capture_stream": (Lane.DECODE, capture_rung), "top_rung": (Lane.DECODE, top),
                               "other_partition": (Lane.PREFILL, capture_rung)}.items():
        with b.lane_context(lane, rung) as s:
            out.fill_(-1)
            graph.replay()
            s.stream.synchronize()
            replays[name] = len({int(x) for x in out.cpu().tolist() if x >= 0})
    return {"captured_on_rung": capture_rung, "decode_units": b.ladder[capture_rung].decode_units,
            "distinct_sms_on_replay": replays}


def events_graph(ctx: Context, deadline: float) -> dict[str, Any]:
    """Cross-context event ordering and timing; a graph's partition when replayed on other streams."""
    import torch

    b = backend(ctx)
    device = torch.device(ctx.device)
    split = [r.index for r in b.ladder if r.partitioned]
    out: dict[str, Any] = {"backend": b.name, "partitioned_rungs": len(split)}
    first, last = (split[0], split[-1]) if split else (b.ladder[-1].index, b.ladder[-1].index)
    out["event_across_contexts"] = _ordered_across(b, first, last, device)
    try:
        launch, _ = smid_launcher()
        blocks = 8 * torch.cuda.get_device_properties(device).multi_processor_count
        out["graph"] = _graph_partition(b, launch, first, device, blocks)
    except Exception as e:  # noqa: BLE001 - the event half still answers
        out["graph"] = {"error": f"{type(e).__name__}: {e}"}
    return out


def plan_only(what: str) -> Any:
    def dry(ctx: Context, deadline: float) -> dict[str, Any]:
        from agentserve.executor.partition.ladder import Granularity, build_ladder

        ladder = build_ladder(132, Granularity(8, 8, "compute-capability"))
        return {"would_measure": what, "rungs_if_h200": len(ladder), "needs": "a CUDA device, triton or cupy"}

    return dry
