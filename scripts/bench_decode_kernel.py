"""Time the compiled CPU decode-attention kernel alone, on the decode lane's thread count, at agent-sized contexts —
and, for kernel work, other versions of its source against it.

    python scripts/bench_decode_kernel.py --threads 1 --json
    python scripts/bench_decode_kernel.py --compare old_paged_decode.c      # e.g. from `git show REV:...`

One call per layer over ``--layers`` caches of their own (distinct memory, as in a real step), for: one sequence of
``--context`` tokens; four that share their first ``--shared`` tokens (the agents' common prompt, cached once);
four with contexts of their own.  fp16 caches, the built-in ``bench`` model's shape by default.  Each version is
run in turn, case by case (``bench_engine.alternate``), ``--repeats`` times; medians are reported with each
version's time over the built kernel's.  Every version's output is checked against the built kernel's first.
Numbers only: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import tempfile
from pathlib import Path

import torch
from bench_engine import alternate

from agentserve.executor.attention import cpu_kernel
from agentserve.executor.kernels import build

ATTENTION = Path(cpu_kernel.__file__).parent  # where paged_decode.c and its headers live


def compile_version(source: Path, into: Path) -> cpu_kernel.PagedDecodeKernel:
    """``source`` (a paged_decode.c) built as the library is, on its own, and wrapped like the built kernel."""
    cc = build.compiler()
    if cc is None:
        raise SystemExit("no C compiler: nothing to compare")
    lib = into / f"{source.stem}-{len(list(into.iterdir()))}.so"
    flags = [f for f in build.COMPILE if f != "-c"]
    done = subprocess.run([cc, *flags, "-shared", build.OPENMP, f"-I{ATTENTION}", str(source), "-o", str(lib), "-lm"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{source} does not compile: {done.stderr[-2000:]}")
    return cpu_kernel.PagedDecodeKernel(ctypes.CDLL(str(lib)))


def case(batch: int, context: int, shared: int, args: argparse.Namespace, seed: int) -> list[tuple]:
    """Per layer: (q, k_cache, v_cache, tables, lens) for ``batch`` sequences of ``context`` tokens, the first
    ``shared`` of them in the same (scattered) blocks for every sequence."""
    g = torch.Generator().manual_seed(seed)
    bs, common = args.block_size, shared // args.block_size
    own = -(-context // bs) - common
    blocks = common + batch * own
    layers = []
    for _ in range(args.layers):
        k, v = (torch.randn(blocks, bs, args.kv_heads, args.dim, generator=g).half() for _ in range(2))
        order = torch.randperm(blocks, generator=g).tolist()
        tables = torch.tensor([order[:common] + order[common + i * own: common + (i + 1) * own] for i in range(batch)])
        lens = torch.full((batch,), context, dtype=torch.int64)
        q = torch.randn(batch, args.heads, args.dim, generator=g)
        layers.append((q, k, v, tables, lens))
    return layers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compare", action="append", default=[], type=Path, metavar="PAGED_DECODE_C",
                   help="another version of attention/paged_decode.c to time against the built kernel; repeatable")
    p.add_argument("--threads", type=int, default=1, help="the kernel's threads (the decode lane has one core of two)")
    p.add_argument("--context", type=int, default=3000, help="cached tokens per sequence")
    p.add_argument("--shared", type=int, default=2048, help="leading tokens the four sharing sequences share")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    args = p.parse_args()

    built = cpu_kernel.load()
    if built is None:
        raise SystemExit("the CPU library does not build here")
    scale = args.dim**-0.5
    cases = {f"b1, {args.context} tokens": case(1, args.context, 0, args, 1),
             f"b4, first {args.shared} shared": case(4, args.context, args.shared, args, 2),
             "b4, contexts of their own": case(4, args.context, 0, args, 3)}
    with tempfile.TemporaryDirectory() as tmp:
        versions = {"built": built} | {str(src): compile_version(src, Path(tmp)) for src in args.compare}
        results: dict[str, dict[str, float]] = {}
        for name, layers in cases.items():
            want = [built(*layer, scale, args.threads) for layer in layers]
            for version, kernel in versions.items():
                got = [kernel(*layer, scale, args.threads) for layer in layers]
                err = max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))
                if err > 1e-4:
                    raise SystemExit(f"{version} differs from the built kernel by {err:.3g} on {name}")
            fns = {v: (lambda k=k, layers=layers: [k(*layer, scale, args.threads) for layer in layers])
                   for v, k in versions.items()}
            results[name] = {v: t * 1e3 for v, t in alternate(fns, torch.device("cpu"), args.repeats, 2).items()}
    if args.json:
        print(json.dumps({"threads": args.threads, "layers": args.layers, "ms": results}))
        return
    for name, times in results.items():
        base = times["built"]
        print(f"{name}: " + ", ".join(f"{v} {t:.2f} ms ({t / base:.2f}x)" for v, t in times.items()))


if __name__ == "__main__":
    main()
