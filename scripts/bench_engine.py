"""Engine micro-benchmark: ModelRunner against Hugging Face transformers (eager) on the same weights.

    python scripts/bench_engine.py --model bench --json

Prefill tokens/s at 256 / 1024 / 4096 tokens; decode step time at batch 1 / 4 / 16 / 32 with 512 tokens of
context per sequence (``--context``); decode batch 1 as a fraction of the memory-bandwidth roofline (weight
bytes divided by the copy bandwidth measured in this run).  The two engines are timed alternately, run by
run and step by step, so that load from other processes on a shared machine hits both alike; medians are
reported.
Numbers only: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from agentserve.executor.fused.helper import DecodeHelper
from agentserve.executor.runner import DecodeItem, ModelRunner, PrefillChunk

PREFILL_LENS = (256, 1024, 4096)
DECODE_BATCHES = (1, 4, 16, 32)
CONTEXT = 512  # cached tokens per decode sequence (--context)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall(fn: Callable[[], object], device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def alternate(fns: dict[str, Callable[[], object]], device: torch.device, runs: int, warmup: int) -> dict[str, float]:
    """Median seconds of each function, calling them in turn ``warmup + runs`` times."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(warmup + runs):
        for name, fn in fns.items():
            t = wall(fn, device)
            if i >= warmup:
                times[name].append(t)
    return {k: statistics.median(v) for k, v in times.items()}


def copy_bandwidth(device: torch.device, nbytes: int = 256 << 20) -> float:
    """Bytes/s of a large device-local copy (read + write counted), best of five."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / min(wall(lambda: dst.copy_(src), device) for _ in range(5))


def weight_bytes(runner: ModelRunner) -> int:
    """Bytes a decode step must stream: every layer matrix and norm and the lm_head (not the embedding)."""
    m = runner.model  # tensors and Linear matrices both have .nbytes
    return m.norm.nbytes + m.lm_head.nbytes + sum(p.nbytes for x in m.layers for p in vars(x).values() if p is not None)


def tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class RunnerSide:
    """ModelRunner; every sequence gets private, linearly allocated blocks; decode steps shared with ``helper``."""

    def __init__(self, runner: ModelRunner, context: int, helper: DecodeHelper | None = None) -> None:
        self.r, self.context, self.helper = runner, context, helper
        self.vocab, self.bs = runner.config.vocab_size, runner.block_size

    def prefill_fn(self, n: int) -> Callable[[], object]:
        chunk = [PrefillChunk(tokens(n, self.vocab, n), 0, list(range(-(-n // self.bs))))]
        return lambda: self.r.prefill(chunk)

    def decode_fn(self, batch: int, steps: int) -> Callable[[], object]:
        """One decode step per call for ``batch`` sequences that start with ``context`` cached tokens each."""
        context = self.context
        per_seq = -(-(context + steps) // self.bs)
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
        self.r.prefill([PrefillChunk(tokens(context, self.vocab, 1), 0, tables[0])])
        ctx = -(-context // self.bs)
        src = torch.tensor(tables[0][:ctx], device=self.r.device)
        for t in tables[1:]:  # each sequence its own copy of the context: distinct memory, as in real use
            dst = torch.tensor(t[:ctx], device=self.r.device)
            for k, v in zip(self.r.kv_cache.k, self.r.kv_cache.v, strict=True):
                k[dst], v[dst] = k[src], v[src]
        pos = [context]

        def step() -> None:
            self.r.decode([DecodeItem(7, pos[0], t) for t in tables], helper=self.helper)
            pos[0] += 1

        return step


class HFSide:
    """transformers eager with its DynamicCache."""

    def __init__(self, path: Path, dtype: torch.dtype, device: torch.device, context: int) -> None:
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation="eager").to(device).eval()
        self.device, self.vocab, self.context = device, self.model.config.vocab_size, context

    def prefill_fn(self, n: int) -> Callable[[], object]:
        ids = torch.tensor([tokens(n, self.vocab, n)], device=self.device)
        return torch.inference_mode()(lambda: self.model(ids, use_cache=True, logits_to_keep=1))

    @torch.inference_mode()
    def decode_fn(self, batch: int, steps: int) -> Callable[[], object]:
        ids = torch.tensor([tokens(self.context, self.vocab, 1)], device=self.device)
        cache = self.model(ids, use_cache=True, logits_to_keep=1).past_key_values
        cache.batch_repeat_interleave(batch)
        nxt = torch.full((batch, 1), 7, device=self.device)
        return torch.inference_mode()(lambda: self.model(nxt, past_key_values=cache, use_cache=True))


def measure(sides: dict, device: torch.device, repeats: int, steps: int) -> dict[str, dict]:
    out = {name: {"prefill_tokens_per_s": {}, "decode_step_ms": {}, "decode_tokens_per_s": {}} for name in sides}
    for n in PREFILL_LENS:
        secs = alternate({k: s.prefill_fn(n) for k, s in sides.items()}, device, repeats, warmup=1)
        for k, sec in secs.items():
            out[k]["prefill_tokens_per_s"][str(n)] = round(n / sec, 1)
        print(f"prefill {n}: " + ", ".join(f"{k} {n / s:.0f} tok/s" for k, s in secs.items()), file=sys.stderr)
    for b in DECODE_BATCHES:
        secs = alternate({k: s.decode_fn(b, steps + 2) for k, s in sides.items()}, device, steps, warmup=2)
        for k, sec in secs.items():
            out[k]["decode_step_ms"][str(b)] = round(sec * 1e3, 3)
            out[k]["decode_tokens_per_s"][str(b)] = round(b / sec, 1)
        print(f"decode batch {b}: " + ", ".join(f"{k} {s * 1e3:.2f} ms" for k, s in secs.items()), file=sys.stderr)
    return out


def describe(runner: ModelRunner) -> dict[str, str]:
    """What engine a runner is: its activations, matrix formats and KV cache type."""
    return {"dtype": str(runner.dtype).removeprefix("torch."), "matrix_format": runner.weight_format,
            "kv_cache_dtype": str(runner.kv_dtype).removeprefix("torch.")}


def ratios(ours: dict, hf: dict) -> dict[str, dict[str, float]]:
    return {
        "prefill_throughput": {n: round(v / hf["prefill_tokens_per_s"][n], 2)
                               for n, v in ours["prefill_tokens_per_s"].items()},
        "decode_step_time": {b: round(hf["decode_step_ms"][b] / v, 2) for b, v in ours["decode_step_ms"].items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench", help="checkpoint folder or built-in name (tiny, bench)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--weights", default="auto", help="auto | dense | fp16 | hybrid (see configs/engine.toml)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto | float32 | float16 (see configs/engine.toml)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = all cores)")
    ap.add_argument("--also", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                    help="another engine setting (dtype, weights, kv_cache_dtype) timed alternately with the main "
                         "one, step by step, as agentserve[SETTING]; repeatable")
    ap.add_argument("--repeats", type=int, default=3, help="timed prefill runs per size (median)")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per batch size (median)")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--context", type=int, default=CONTEXT, help="cached tokens per decode sequence")
    ap.add_argument("--json", action="store_true", help="print the result as one line of JSON")
    ap.add_argument("--decode-helper", action="store_true",
                    help="also time agentserve[decode_helper]: one-thread decode steps shared with the decode helper "
                         "(the calling thread pinned to the first CPU, the helper on the others, as in a server)")
    args = ap.parse_args()

    from agentserve.executor.builtin import resolve_model

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    path = resolve_model(args.model)
    blocks = max(DECODE_BATCHES) * -(-(args.context + args.steps + 8) // 16) + max(PREFILL_LENS) // 16
    def new_runner(**changed: str) -> ModelRunner:
        settings = {"dtype": args.dtype, "weights": args.weights, "kv_cache_dtype": args.kv_cache_dtype} | changed
        return ModelRunner(path, device=args.device, num_blocks=blocks, **settings)

    runner = new_runner()
    sides: dict = {"agentserve": RunnerSide(runner, args.context)}
    engines = {}
    for spec in args.also:
        other = new_runner(**dict(kv.split("=", 1) for kv in spec.split(",")))
        sides[f"agentserve[{spec}]"] = RunnerSide(other, args.context)
        engines[f"agentserve[{spec}]"] = describe(other)
    helper = _helper_side(args.context, new_runner(), sides, engines) if args.decode_helper else None
    if not args.no_hf:
        sides["transformers_eager"] = HFSide(path, runner.dtype, runner.device, args.context)
    bw = copy_bandwidth(runner.device)
    result = {
        "model": str(args.model), "architecture": runner.config.architecture, "device": str(runner.device),
        **describe(runner), "engines_also": engines,
        "threads": torch.get_num_threads(),
        "decode_context_tokens": args.context, "weight_bytes": weight_bytes(runner),
        "copy_bandwidth_gb_s": round(bw / 1e9, 2),
        "load_average_before": round(os.getloadavg()[0], 2),  # timings are only meaningful on a quiet machine
    }
    result |= measure(sides, runner.device, args.repeats, args.steps)
    result["load_average_after"] = round(os.getloadavg()[0], 2)
    ours = result["agentserve"]
    roofline_ms = result["weight_bytes"] / bw * 1e3
    result["decode_b1_roofline_ms"] = round(roofline_ms, 3)
    result["decode_b1_fraction_of_roofline"] = round(roofline_ms / ours["decode_step_ms"]["1"], 3)
    result["decode_b32_over_b1_tokens_per_s"] = round(
        ours["decode_tokens_per_s"]["32"] / ours["decode_tokens_per_s"]["1"], 2)
    if "transformers_eager" in result:
        result["agentserve_vs_transformers"] = ratios(ours, result["transformers_eager"])
    if helper is not None:
        result["decode_helper_counts"] = helper.counts()
        helper.close()
    print(json.dumps(result, indent=None if args.json else 2))


def _helper_side(context: int, other: ModelRunner, sides: dict, engines: dict) -> DecodeHelper:
    """``other`` (a second runner) with its decode steps shared by the decode helper, as the server's decode lane
    does: one intra-op thread on the first CPU, the helper (at ``SCHED_IDLE``) on the others."""
    cpus = sorted(os.sched_getaffinity(0))
    if torch.get_num_threads() != 1 or len(cpus) < 2:
        raise SystemExit("--decode-helper needs --threads 1 and a second CPU (the helper runs beside the lane thread)")
    helper = other.new_decode_helper()
    if helper is None:
        raise SystemExit("--decode-helper needs the fused CPU decode step")
    os.sched_setaffinity(0, cpus[:1])
    helper.start(cpus[1:])
    sides["agentserve[decode_helper]"] = RunnerSide(other, context, helper)
    engines["agentserve[decode_helper]"] = describe(other)
    return helper


if __name__ == "__main__":
    main()
