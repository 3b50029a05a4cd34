"""Device probe section ``attention``: decode step and prefill times per attention backend, eager vs CUDA graphs.

On a ~1B Llama-shaped bf16 model with random weights (hidden 2048, 16 layers, 32 heads / 8 KV heads of 64,
vocab 128256): decode steps of batch 1 / 8 / 32 at 2k and 8k cached tokens with the PyTorch, Triton and (when
installed) FlashInfer backends, eagerly and (Triton) replayed as CUDA graphs, and prefill tokens/s for a
fresh 8k-token chunk and a 2k chunk after 6k cached tokens.  A decode step is ``ModelRunner.decode`` (logits,
no sampling) on the default stream: wall time around it (host included, synchronised) and GPU time between
CUDA events around it; p50 and p95 over the timed steps.  The KV cache holds zeros: attention reads the same
bytes whatever they hold.  One JSON line per measurement goes to ``<out>/attention.jsonl``.

``--dry-run`` walks the same code on a CPU with a tiny model and host timers only: the PyTorch backend, the
Triton kernels in Triton's interpreter and the graph path with a stand-in capture, so a CPU machine checks
everything but the GPU.  Imports only what the device image has (torch, numpy,
safetensors; triton and flashinfer when present); ``run()`` is the entry point the probe calls.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SECTION = "attention"
FOLDERS = ("protocol", "orchestrator", "executor", "shm", "cli", "client", "bench", "configs")
LLAMA_1B = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
            "intermediate_size": 8192, "vocab_size": 128256, "tie_word_embeddings": True, "rope_theta": 500000.0}
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "vocab_size": 256, "tie_word_embeddings": True, "rope_theta": 10000.0}


@dataclass
class Settings:
    shape: dict[str, Any]
    device: str
    dtype: str
    batches: list[int]
    contexts: list[int]
    prefill: list[tuple[int, int]]  # (cached tokens, chunk tokens)
    steps: int
    warmup: int
    block_size: int = 16
    backends: list[str] = field(default_factory=list)

    @property
    def max_len(self) -> int:
        return max([*self.contexts, *(s + n for s, n in self.prefill)]) + 1


def device_settings() -> Settings:
    return Settings(LLAMA_1B, "cuda", "bfloat16", [1, 8, 32], [2048, 8192], [(0, 8192), (6144, 2048)], 20, 3)


def dry_settings() -> Settings:
    return Settings(TINY, "cpu", "float32", [1, 2], [64, 128], [(0, 96), (64, 32)], 2, 1)


def ensure_importable() -> None:
    """``import agentserve.*`` from this checkout when the package is not installed (symlinks in a temp dir)."""
    try:
        import agentserve.executor.runner  # noqa: F401
    except ImportError:
        shim = Path(tempfile.mkdtemp(prefix="agentserve-shim-")) / "agentserve"
        shim.mkdir()
        for folder in FOLDERS:
            (shim / folder).symlink_to(REPO / folder)
        sys.path.insert(0, str(shim.parent))


def available_backends(device: str) -> list[str]:
    """PyTorch, plus Triton and FlashInfer where installed (on a CPU: Triton in its interpreter, no FlashInfer)."""
    import importlib.util

    names = ("triton", "flashinfer") if device == "cuda" else ("triton",)
    return ["torch"] + [n for n in names if importlib.util.find_spec(n) is not None]


def write_checkpoint(folder: Path, shape: dict[str, Any], dtype: str, max_len: int) -> Path:
    """A Llama checkpoint with N(0, 0.02) weights (norms 1) in ``dtype``, made on the GPU when there is one."""
    import torch
    from safetensors.torch import save_file

    h, layers, heads, kv = (shape[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                "num_key_value_heads"))
    d, inter, vocab = h // heads, shape["intermediate_size"], shape["vocab_size"]
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (heads * d, h), p + "self_attn.k_proj.weight": (kv * d, h),
                   p + "self_attn.v_proj.weight": (kv * d, h), p + "self_attn.o_proj.weight": (h, heads * d),
                   p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter)}
    gen_device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(gen_device).manual_seed(0)
    tensors = {}
    for name, s in shapes.items():
        t = torch.ones(s) if name.endswith("norm.weight") else torch.empty(s, device=gen_device).normal_(0, 0.02,
                                                                                                           generator=g)
        tensors[name] = t.to(getattr(torch, dtype)).cpu()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    config = {**shape, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
              "max_position_embeddings": max_len, "torch_dtype": dtype, "eos_token_id": None}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def build_runner(path: Path, s: Settings) -> Any:
    from agentserve.executor.runner import ModelRunner

    per_seq = -(-s.max_len // s.block_size)
    blocks = max(s.batches) * per_seq + per_seq
    return ModelRunner(path, dtype=s.dtype, device=s.device, block_size=s.block_size, num_blocks=blocks,
                       attention_backend="torch", max_model_len=s.max_len)


def use_backend(runner: Any, name: str) -> None:
    """Swap the runner's attention backend (same weights and cache) and compile its kernels."""
    import torch

    from agentserve.executor.attention import create_backend

    runner.drop_graphs()
    c = runner.config
    runner.attention = create_backend(name, c.num_heads, c.num_kv_heads, c.head_dim, runner.block_size,
                                      runner.device, runner.dtype)
    with torch.inference_mode():
        runner.attention.warmup(runner.kv_cache.k[0], runner.kv_cache.v[0])


def decode_items(batch: int, context: int, s: Settings) -> list[Any]:
    """Sequence ``i`` owns its own run of blocks (no sharing: every row reads its own bytes)."""
    from agentserve.executor.runner import DecodeItem

    per_seq = -(-s.max_len // s.block_size)
    return [DecodeItem(1, context, list(range(i * per_seq, (i + 1) * per_seq))) for i in range(batch)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def time_steps(step: Any, steps: int, warmup: int, cuda: bool) -> dict[str, Any]:
    """Wall and (CUDA) GPU milliseconds of ``step()`` over ``steps`` runs after ``warmup``."""
    import torch

    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
    wall, gpu = [], []
    for _ in range(steps):
        start = torch.cuda.Event(enable_timing=True) if cuda else None
        end = torch.cuda.Event(enable_timing=True) if cuda else None
        t0 = time.perf_counter()
        if cuda:
            start.record()
        step()
        if cuda:
            end.record()
            torch.cuda.synchronize()
            gpu.append(start.elapsed_time(end))
        wall.append((time.perf_counter() - t0) * 1e3)
    out = {"steps": steps, "wall_ms_p50": percentile(wall, 0.5), "wall_ms_p95": percentile(wall, 0.95)}
    if gpu:
        out |= {"gpu_ms_p50": percentile(gpu, 0.5), "gpu_ms_p95": percentile(gpu, 0.95),
                "wall_over_gpu_p50": percentile(wall, 0.5) / percentile(gpu, 0.5)}
    return out


def measure_decode(runner: Any, backend: str, graphs: bool, s: Settings) -> list[dict[str, Any]]:
    rows = []
    for context in s.contexts:
        for batch in s.batches:
            items = decode_items(batch, context, s)
            rung = 0 if graphs else None
            timing = time_steps(lambda it=items, r=rung: runner.decode(it, r), s.steps, s.warmup,
                                s.device == "cuda")
            rows.append({"kind": "decode", "backend": backend, "graphs": graphs, "batch": batch,
                         "context": context, **timing})
    return rows


def measure_prefill(runner: Any, backend: str, s: Settings) -> list[dict[str, Any]]:
    from agentserve.executor.runner import PrefillChunk

    table = list(range(-(-s.max_len // s.block_size)))
    rows = []
    for cached, tokens in s.prefill:
        chunk = PrefillChunk([1] * tokens, cached, table)
        timing = time_steps(lambda c=chunk: runner.prefill([c]), max(1, s.steps // 4), 1, s.device == "cuda")
        timing["tokens_per_s"] = tokens / (timing["wall_ms_p50"] / 1e3)
        rows.append({"kind": "prefill", "backend": backend, "cached": cached, "tokens": tokens, **timing})
    return rows


def plan(s: Settings) -> list[str]:
    """The measurements a run makes, in words (what ``--dry-run`` lists)."""
    out = []
    for b in s.backends:
        modes = ["eager", "graphs"] if b == "triton" else ["eager"]
        out += [f"decode {b} {m} batch {n} context {c}" for m in modes for c in s.contexts for n in s.batches]
        out += [f"prefill {b} {t} tokens after {c}" for c, t in s.prefill]
    return out


def run(out_dir: Path, dry_run: bool = False) -> list[dict[str, Any]]:
    """Measure, append one JSON line per measurement to ``out_dir/attention.jsonl``, return the records."""
    if dry_run:  # Triton's CPU interpreter: must be chosen before Triton is first imported
        os.environ["TRITON_INTERPRET"] = "1"
    ensure_importable()
    import torch

    s = dry_settings() if dry_run else device_settings()
    s.backends = available_backends(s.device)
    out_dir.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="agentserve-probe-model-") as tmp:
        runner = build_runner(write_checkpoint(Path(tmp), s.shape, s.dtype, s.max_len), s)
        if dry_run:  # graphs' static-buffer path with a stand-in capture (no CUDA graph on a CPU)
            runner.graphs_wanted, runner.graph_max_batch = True, max(s.batches)
        for backend in s.backends:
            use_backend(runner, backend)
            records += measure_decode(runner, backend, False, s)
            if backend == "triton" and runner.graphs_unavailable() is None:
                cuda = runner.device.type == "cuda"
                sms = torch.cuda.get_device_properties(runner.device).multi_processor_count if cuda else 1
                runner.capture_graphs(rung=0, sm_count=sms)
                records += measure_decode(runner, backend, True, s)
            records += measure_prefill(runner, backend, s)
        runner.drop_graphs()
    with open(out_dir / "attention.jsonl", "a") as f:
        for r in records:
            f.write(json.dumps({"section": SECTION, "dry_run": dry_run, "dtype": s.dtype, **r}) + "\n")
    return records


def summary(records: list[dict[str, Any]]) -> str:
    lines = []
    for r in records:
        gpu = f" gpu p50 {r['gpu_ms_p50']:.3f} ms" if "gpu_ms_p50" in r else ""
        if r["kind"] == "decode":
            mode = "graphs" if r["graphs"] else "eager"
            lines.append(f"decode {r['backend']:<10} {mode:<6} b{r['batch']:<3} ctx {r['context']:<5} "
                         f"wall p50 {r['wall_ms_p50']:.3f} ms p95 {r['wall_ms_p95']:.3f} ms{gpu}")
        else:
            lines.append(f"prefill {r['backend']:<10} {r['tokens']} tokens after {r['cached']}: "
                         f"{r['tokens_per_s']:.0f} tok/s{gpu}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/agentserve-probe"))
    p.add_argument("--dry-run", action="store_true", help="a tiny model on the CPU: every path but the GPU's")
    a = p.parse_args(argv)
    s = dry_settings() if a.dry_run else device_settings()
    s.backends = available_backends(s.device)
    print(f"== {SECTION}: {len(plan(s))} measurements" + (" (dry run: tiny model on the CPU)" if a.dry_run else ""))
    for line in plan(s):
        print("  " + line)
    print(summary(run(a.out, a.dry_run)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
