"""Section ``model``: the engine's real steps on a ~1B Llama-shaped bf16 model with random weights.

Decode batch 32 at 2k context — alone, beside an 8k-token prefill on the other lane, per rung, and
time-sliced with the prefill on one stream — each step's wall time (what a client sees) and GPU time
(CUDA events on the lane's stream); prefill tokens/s; a control with a Python-only busy thread beside
decode (how much of any slowdown is the GIL, not the GPU); the first-use and steady cost of switching
rungs.  On a CPU (``--dry-run``) the same code runs the built-in ``tiny`` model at toy sizes on the
cpu-cores backend, so every path but the CUDA events is exercised.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from probe.common import Budget, Context, stats_ms

LLAMA_1B = {  # the shape of Llama 3.2 1B: 1.24 B parameters
    "architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 8192,
    "vocab_size": 128256, "tie_word_embeddings": True, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 16384, "hidden_act": "silu", "torch_dtype": "bfloat16", "eos_token_id": 1,
}


@dataclass
class Shape:
    batch: int
    context: int
    prefill: int
    steps: int


GPU_SHAPE = Shape(batch=32, context=2048, prefill=8192, steps=20)
CPU_SHAPE = Shape(batch=2, context=32, prefill=64, steps=4)


def random_weights(cfg: dict[str, Any], device: Any) -> dict[str, Any]:
    """Every tensor a Llama checkpoint of ``cfg`` has, random bf16 (×0.02) made on ``device``."""
    import torch

    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]

    def rnd(*shape: int) -> Any:
        return torch.randn(*shape, device=device, dtype=torch.bfloat16) * 0.02

    out = {"model.embed_tokens.weight": rnd(v, h), "model.norm.weight": torch.ones(h, device=device)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": torch.ones(h, device=device),
                p + "post_attention_layernorm.weight": torch.ones(h, device=device),
                p + "self_attn.q_proj.weight": rnd(q, h), p + "self_attn.k_proj.weight": rnd(kv, h),
                p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, q),
                p + "mlp.gate_proj.weight": rnd(inter, h), p + "mlp.up_proj.weight": rnd(inter, h),
                p + "mlp.down_proj.weight": rnd(h, inter)}
    return out


def build_runner(device: str, shape: Shape, cfg: dict[str, Any] = LLAMA_1B, **runner_kw: Any) -> Any:
    """A ModelRunner on ``cfg`` with random weights made on the device (no checkpoint files written)."""
    import torch

    from agentserve.executor import runner as runner_module

    make = runner_module.load_weights
    runner_module.load_weights = lambda model_dir, *a, **k: random_weights(cfg, torch.device(device))
    try:
        with tempfile.TemporaryDirectory(prefix="agentserve-probe-model-") as folder:
            (Path(folder) / "config.json").write_text(json.dumps(cfg))
            per_seq = -(-(shape.context + 64) // 16)
            blocks = shape.batch * per_seq + -(-shape.prefill // 16) + 1
            return runner_module.ModelRunner(folder, dtype="bfloat16", device=device, num_blocks=blocks, **runner_kw)
    finally:
        runner_module.load_weights = make


class Steps:
    """Decode steps and prefill chunks of one workload as lane step functions that time themselves."""

    def __init__(self, wl: Any, events: bool) -> None:
        self.wl, self.events = wl, events
        self.wall: list[float] = []
        self.gpu: list[float] = []
        self._last = 0.0

    def reset(self) -> None:
        self.wall, self.gpu, self._last = [], [], time.perf_counter()

    def decode(self, binding: Any) -> None:
        start = self._event(binding)
        self.wl.runner.decode(self._items())
        self._finish(binding, start)
        now = time.perf_counter()
        self.wall.append(now - self._last)  # completion to completion: the inter-token time a client sees
        self._last = now

    def _items(self) -> list[Any]:
        from agentserve.executor.runner import DecodeItem

        wl = self.wl
        pos = wl.context + wl.step % 64
        wl.step += 1
        return [DecodeItem(5, pos, t) for t in wl.tables]

    def _event(self, binding: Any) -> Any:
        if not (self.events and binding.stream is not None):
            return None
        import torch

        start = torch.cuda.Event(enable_timing=True)
        start.record(binding.stream)
        return start

    def _finish(self, binding: Any, start: Any) -> None:
        if binding.stream is None:
            return
        if start is None:
            binding.stream.synchronize()
            return
        import torch

        end = torch.cuda.Event(enable_timing=True)
        end.record(binding.stream)
        end.synchronize()
        self.gpu.append(start.elapsed_time(end) / 1e3)

    def prefill(self, binding: Any) -> None:
        self.wl.prefill_chunk(0)(binding)


def _series(steps: Steps) -> dict[str, Any]:
    return {"wall": stats_ms(steps.wall[1:]), "gpu": stats_ms(steps.gpu[1:])}


def alone(b: Any, steps: Steps, rung: int, n: int, busy: bool = False) -> dict[str, Any]:
    """``n`` decode steps on ``rung``; with ``busy`` a pure-Python thread spins beside them (GIL control: at
    Python's default 5 ms switch interval one such step took ~8 s instead of 17 ms on an H200)."""
    from agentserve.executor.lanes import LaneWorker
    from agentserve.protocol.lanes import Lane

    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    spinner = threading.Thread(target=spin, daemon=True) if busy else None
    with LaneWorker(b, Lane.DECODE, rung) as dec:
        dec.submit(steps.decode).result()
        if spinner:
            spinner.start()
        steps.reset()
        for _ in range(n + 1):
            dec.submit(steps.decode).result()
    stop.set()
    return _series(steps)


def beside_prefill(b: Any, steps: Steps, rung: int, n: int, chunk_s: float, step_s: float) -> dict[str, Any]:
    """Decode steps on ``rung`` while the prefill lane runs 8k-token chunks there; prefill tokens/s."""
    from agentserve.executor.lanes import LaneWorker
    from agentserve.protocol.lanes import Lane

    chunks = max(2, int(n * step_s / max(chunk_s, 1e-6)) + 2)
    with LaneWorker(b, Lane.DECODE, rung) as dec, LaneWorker(b, Lane.PREFILL, rung) as pre:
        dec.submit(steps.decode).result()
        pre.submit(steps.prefill).result()  # bound and warm before the clock starts
        t0 = time.perf_counter()
        futures = [pre.submit(steps.prefill).future for _ in range(chunks)]
        steps.reset()
        while not futures[-1].done() and len(steps.wall) < 4 * n:
            dec.submit(steps.decode).result()
        for f in futures:
            f.result()
        seconds = time.perf_counter() - t0
    return {**_series(steps), "prefill_tokens_per_s": round(chunks * steps.wl.prefill_tokens / seconds),
            "chunks": chunks}


def time_sliced(b: Any, steps: Steps, rung: int, chunks: int) -> dict[str, Any]:
    """One lane alternates a decode step and a prefill chunk: the inter-token time a chunked engine gives."""
    from agentserve.executor.lanes import LaneWorker
    from agentserve.protocol.lanes import Lane

    with LaneWorker(b, Lane.DECODE, rung) as lane:
        lane.submit(steps.decode).result()
        steps.reset()
        for _ in range(chunks):
            lane.submit(steps.prefill)
            lane.submit(steps.decode).result()
    return {"wall": stats_ms(steps.wall), "gpu_decode_only": stats_ms(steps.gpu)}


def gil_control(b: Any, steps: Steps, rung: int, interval_s: float = 2e-4, n: int = 2) -> dict[str, Any]:
    """Decode beside a pure-Python busy thread at a short GIL switch interval (``sys.setswitchinterval``):
    whether the convoy cost scales with the interval.  Few steps: each one waits for the GIL at every release."""
    import sys

    before = sys.getswitchinterval()
    sys.setswitchinterval(interval_s)
    try:
        return {"switch_interval_s": interval_s, **alone(b, steps, rung, n, busy=True)}
    finally:
        sys.setswitchinterval(before)


def first_use(b: Any, steps: Steps, rungs: list[int]) -> list[dict[str, Any]]:
    """The first decode step on each rung's decode stream (kernels load per context) and the one after."""
    from agentserve.executor.lanes import LaneWorker
    from agentserve.protocol.lanes import Lane

    rows = []
    for rung in rungs:
        with LaneWorker(b, Lane.DECODE, rung) as dec:
            times = []
            for _ in range(2):
                t0 = time.perf_counter()
                dec.submit(steps.decode).result()
                times.append(round((time.perf_counter() - t0) * 1e3, 2))
        rows.append({"rung": rung, "first_ms": times[0], "second_ms": times[1]})
    return rows


def switching(b: Any, steps: Steps, rung: int, n: int) -> dict[str, Any]:
    """Decode steps alternating between ``rung`` and the top rung, vs staying on one: the steady switch cost."""
    from agentserve.executor.lanes import LaneWorker
    from agentserve.protocol.lanes import Lane

    top = b.ladder[-1].index
    with LaneWorker(b, Lane.DECODE, top) as dec:
        dec.submit(steps.decode).result()
        steps.reset()
        for i in range(n + 1):
            dec.submit(steps.decode, rung=rung if i % 2 else top).result()
    return {"between": [rung, top], **_series(steps)}


def measure(ctx: Context, deadline: float, b: Any, runner: Any, shape: Shape, events: bool) -> dict[str, Any]:
    """Everything above, rung by rung until the deadline (top rung and the middle one first)."""
    import lane_check

    wl = lane_check.Workload(runner, shape.batch, shape.context, shape.prefill, shape.prefill)
    steps = Steps(wl, events)
    top = b.ladder[-1].index
    split = [r.index for r in b.ladder if r.partitioned]
    order = [top, *([split[len(split) // 2]] if split else []), *split]
    order = list(dict.fromkeys(order))
    out: dict[str, Any] = {"first_use": first_use(b, steps, order)}
    from agentserve.executor.lanes import LaneWorker
    from agentserve.protocol.lanes import Lane

    with LaneWorker(b, Lane.DECODE, top) as dec:
        dec.submit(wl.warm).result()
        t0 = time.perf_counter()
        dec.submit(steps.prefill).result()
        chunk_s = time.perf_counter() - t0
    base = alone(b, steps, top, shape.steps)
    step_s = max(base["wall"].get("p50_ms", 1.0), 0.01) / 1e3
    out |= {"prefill_chunk_s": round(chunk_s, 4), "alone_top": base,
            "time_sliced_top": time_sliced(b, steps, top, max(3, shape.steps // 4))}
    budget, rows = Budget(deadline), []
    for rung in order:
        if not budget.more():
            break
        r = b.ladder[rung]
        rows.append({"rung": rung, "decode_units": r.decode_units, "prefill_units": r.prefill_units,
                     "partitioned": r.partitioned, "alone": alone(b, steps, rung, shape.steps),
                     "beside_prefill": beside_prefill(b, steps, rung, shape.steps, chunk_s, step_s)})
    out["rungs"] = rows
    if split and budget.more():
        out["switching"] = switching(b, steps, split[len(split) // 2], shape.steps)
    if budget.more():
        out["gil_control_top"] = gil_control(b, steps, top)
    out["cut_by_budget"] = budget.cut
    return out


def model(ctx: Context, deadline: float) -> dict[str, Any]:
    from probe.partitions import backend

    b = backend(ctx)
    t0 = time.perf_counter()
    runner = build_runner(ctx.device, GPU_SHAPE)
    params = sum(w.numel() for w in random_weights_counts())
    out = {"model": "Llama-3.2-1B shape, random bf16", "parameters": params,
           "build_s": round(time.perf_counter() - t0, 1), "attention_backend": type(runner.attention).__name__,
           "weights": runner.weight_format, "shape": GPU_SHAPE.__dict__}
    return out | measure(ctx, deadline, b, runner, GPU_SHAPE, events=ctx.found.get("events_ok", True))


def random_weights_counts() -> list[Any]:
    """Parameter tensors of LLAMA_1B as meta tensors (for the count, no memory)."""
    return list(random_weights(LLAMA_1B, "meta").values())


def model_dry(ctx: Context, deadline: float) -> dict[str, Any]:
    """The same measurement code on the CPU: the built-in tiny model's config, toy sizes, cpu-cores lanes."""
    from agentserve.executor.builtin import resolve_model
    from agentserve.executor.partition.cpu_cores import CpuCoresBackend

    cfg = json.loads((resolve_model("tiny") / "config.json").read_text())
    cfg = {**cfg, "architectures": ["LlamaForCausalLM"], "tie_word_embeddings": True}
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    runner = build_runner("cpu", CPU_SHAPE, cfg)
    b = CpuCoresBackend()
    try:
        result = measure(ctx, deadline, b, runner, CPU_SHAPE, events=False)
    finally:
        b.close()
    params = sum(w.numel() for w in random_weights_counts())
    return {"gpu_model_parameters": params, "cpu_stand_in": "tiny config as Llama, toy sizes", **result}
