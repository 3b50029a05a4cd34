"""Measure decode step times on the lanes: alone, time-sliced with a long prefill, and partitioned.

Shared by ``scripts/bench_lanes.py`` (CPU) and ``scripts/gpu_check.sh`` (per rung on a GPU).
The *decode step time* is the inter-token latency of a decode batch: the time between the
completions of consecutive decode steps, as a client streaming tokens would see it.

- alone:        decode steps on the decode lane, nothing else running.
- time-sliced:  one lane alternates decode steps and prefill chunks (a chunked-prefill engine).
- partitioned:  decode steps on the decode lane while the prefill lane runs the prefill chunks.

On CUDA each step synchronises its stream before it counts as done.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentserve.executor.builtin import resolve_model
from agentserve.executor.lanes import LaneWorker
from agentserve.executor.partition.base import LaneBinding, PartitionBackend
from agentserve.executor.runner import DecodeItem, ModelRunner, PrefillChunk
from agentserve.protocol.lanes import Lane

WRAP = 64  # decode positions cycle through this many slots after the context (KV rewritten in place)


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100)."""
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]


def summary(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"n": 0}
    return {
        "n": len(xs),
        "p50_ms": round(percentile(xs, 50) * 1e3, 3),
        "p95_ms": round(percentile(xs, 95) * 1e3, 3),
        "mean_ms": round(sum(xs) / len(xs) * 1e3, 3),
    }


def _sync(binding: LaneBinding) -> None:
    if binding.stream is not None:
        binding.stream.synchronize()


@dataclass
class Workload:
    """A decode batch of ``batch`` sequences at ``context`` tokens, and one ``prefill_tokens`` prompt."""

    runner: ModelRunner
    batch: int
    context: int
    prefill_tokens: int
    chunk: int
    repeat: int = 1  # the prefill prompt is run this many times back to back (keeps a fast GPU busy)

    def __post_init__(self) -> None:
        bs, vocab = self.runner.block_size, self.runner.config.vocab_size
        per_seq = -(-(self.context + WRAP) // bs)
        self.tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(self.batch)]
        first = self.batch * per_seq
        self.prefill_table = list(range(first, first + -(-self.prefill_tokens // bs)))
        self.prompt = [(i * 131 + 7) % (vocab - 3) + 3 for i in range(self.prefill_tokens)]
        self.step = 0

    @property
    def blocks_needed(self) -> int:
        return self.prefill_table[-1] + 1

    def warm(self, binding: LaneBinding) -> None:
        """Prefill the decode batch's contexts (untimed)."""
        ctx = [(i * 17 + 5) % (self.runner.config.vocab_size - 3) + 3 for i in range(self.context)]
        self.runner.prefill([PrefillChunk(ctx, 0, t) for t in self.tables])
        _sync(binding)

    def decode(self, binding: LaneBinding) -> None:
        pos = self.context + self.step % WRAP
        self.runner.decode([DecodeItem(5, pos, t) for t in self.tables])
        _sync(binding)
        self.step += 1

    @property
    def n_chunks(self) -> int:
        return -(-self.prefill_tokens // self.chunk) * self.repeat

    def prefill_chunk(self, i: int) -> Callable[[LaneBinding], None]:
        per_prompt = -(-self.prefill_tokens // self.chunk)

        def run(binding: LaneBinding) -> None:
            start = (i % per_prompt) * self.chunk
            tokens = self.prompt[start : start + self.chunk]
            self.runner.prefill([PrefillChunk(tokens, start, self.prefill_table)])
            _sync(binding)

        return run


def load(
    model: str, device: str, dtype: str, batch: int, context: int, prefill: int, chunk: int, repeat: int = 1
) -> Workload:
    block = 16
    per_seq = -(-(context + WRAP) // block)
    blocks = batch * per_seq + -(-prefill // block)
    runner = ModelRunner(resolve_model(model), dtype=dtype, device=device, block_size=block, num_blocks=blocks)
    return Workload(runner, batch, context, prefill, chunk, repeat)


def _itl(worker: LaneWorker, wl: Workload, keep_going: Callable[[int], bool]) -> list[float]:
    """Run decode steps while ``keep_going(steps so far)``; return the gaps between completions."""
    worker.submit(wl.decode).result()
    prev, gaps = time.monotonic(), []
    while keep_going(len(gaps)):
        worker.submit(wl.decode).result()
        now = time.monotonic()
        gaps.append(now - prev)
        prev = now
    return gaps


def alone_gaps(backend: PartitionBackend, wl: Workload, rung: int, steps: int) -> list[float]:
    with LaneWorker(backend, Lane.DECODE, rung) as dec:
        return _itl(dec, wl, lambda n: n < steps)


def alone(backend: PartitionBackend, wl: Workload, rung: int, steps: int) -> dict[str, Any]:
    return summary(alone_gaps(backend, wl, rung, steps))


def time_sliced(backend: PartitionBackend, wl: Workload, rung: int) -> dict[str, Any]:
    """One lane: decode step, prefill chunk, decode step, … until the prefill is done."""
    gaps: list[float] = []
    with LaneWorker(backend, Lane.DECODE, rung) as lane:
        lane.submit(wl.decode).result()
        prev, t0 = time.monotonic(), time.monotonic()
        for i in range(wl.n_chunks):
            lane.submit(wl.prefill_chunk(i))
            lane.submit(wl.decode).result()
            now = time.monotonic()
            gaps.append(now - prev)
            prev = now
        prefill_s = time.monotonic() - t0
    return {**summary(gaps), "prefill_s": round(prefill_s, 3)}


def partitioned(backend: PartitionBackend, wl: Workload, rung: int) -> dict[str, Any]:
    """Decode lane steps for as long as the prefill lane runs the chunks (only those steps count)."""
    with LaneWorker(backend, Lane.DECODE, rung) as dec, LaneWorker(backend, Lane.PREFILL, rung) as pre:
        dec.submit(wl.decode).result()  # the decode lane is bound and warm before the prefill starts
        t0 = time.monotonic()
        chunks = [pre.submit(wl.prefill_chunk(i)) for i in range(wl.n_chunks)]
        last = chunks[-1].future
        gaps = _itl(dec, wl, lambda n: not last.done())
        last.result()
        prefill_s = time.monotonic() - t0
    return {**summary(gaps), "prefill_s": round(prefill_s, 3)}


def warm_up(backend: PartitionBackend, wl: Workload, rung: int) -> None:
    with LaneWorker(backend, Lane.DECODE, rung) as dec:
        dec.submit(wl.warm).result()
        for _ in range(3):
            dec.submit(wl.decode).result()
    with LaneWorker(backend, Lane.PREFILL, rung) as pre:
        pre.submit(wl.prefill_chunk(0)).result()


def ratio(a: dict[str, Any], b: dict[str, Any], key: str = "p95_ms") -> float | None:
    if not a.get(key) or not b.get(key):
        return None
    return round(a[key] / b[key], 3)


def common_args(parser: Any) -> None:
    parser.add_argument("--model", default="bench", help="builtin name or checkpoint folder")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--partition", default=None, help="start detection at this backend")
    parser.add_argument("--batch", type=int, default=8, help="sequences in the decode batch")
    parser.add_argument("--context", type=int, default=128, help="tokens already cached per decode sequence")
    parser.add_argument("--prefill-tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk size (tokens per step)")
    parser.add_argument("--prefill-repeat", type=int, default=1, help="run the prefill prompt N times")
    parser.add_argument("--steps", type=int, default=30, help="decode steps measured alone")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def setup(args: Any) -> tuple[PartitionBackend, Workload]:
    from agentserve.executor.partition import detect
    from agentserve.executor.partition.torch_cuda import TorchCuda, device_index

    wl = load(
        args.model,
        args.device,
        args.dtype,
        args.batch,
        args.context,
        args.prefill_tokens,
        args.chunk,
        args.prefill_repeat,
    )
    backend = detect(args.partition, cuda=TorchCuda(device_index(wl.runner.device)))
    if (wl.runner.device.type == "cuda") != (backend.unit == "SMs"):
        raise SystemExit(f"model on {wl.runner.device} but partition backend {backend.name}; pass --device")
    return backend, wl


def header(backend: PartitionBackend, wl: Workload, args: Any) -> dict[str, Any]:
    return {
        "backend": backend.name,
        "reason": backend.reason,
        "device": backend.device,
        "unit": backend.unit,
        "model": args.model,
        "dtype": str(wl.runner.dtype).removeprefix("torch."),
        "matrix_format": wl.runner.weight_format,
        "batch": wl.batch,
        "context": wl.context,
        "prefill_tokens": wl.prefill_tokens,
        "chunk": wl.chunk,
        "prefill_repeat": wl.repeat,
    }


def main() -> None:
    """Per rung: decode alone vs with a concurrent long prefill on the other lane (gpu_check.sh)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(parser)
    args = parser.parse_args()
    backend, wl = setup(args)
    try:
        out = header(backend, wl, args)
        top = backend.ladder[-1].index
        warm_up(backend, wl, top)
        out["time_sliced"] = time_sliced(backend, wl, top)
        rows = []
        for rung in backend.ladder:
            a = alone(backend, wl, rung.index, args.steps)
            p = partitioned(backend, wl, rung.index)
            rows.append(
                {
                    "rung": rung.index,
                    "decode_units": rung.decode_units,
                    "prefill_units": rung.prefill_units,
                    "partitioned": rung.partitioned,
                    "alone": a,
                    "with_prefill": p,
                    "p95_ratio": ratio(p, a),
                }
            )
            if not args.json:
                print(json.dumps(rows[-1]), flush=True)
        out["rungs"] = rows
        print(json.dumps(out, indent=None if args.json else 2))
    finally:
        backend.close()


if __name__ == "__main__":
    main()
