"""Time the prefill steps an agent workload sends to the prefill lane — a short resume over a long cached context and
cold chunks at growing context — for several ``prefill_attention`` settings, on the lane's thread count.

    python scripts/bench_prefill_steps.py --model bench --settings auto,torch --threads 1 --json

Each setting gets its own ``ModelRunner`` over the same checkpoint; every step is run on each runner in turn
(``bench_engine.alternate``: load from other processes hits all alike), ``--repeats`` times; medians are reported,
with the ratio of each setting's time to the first one's.  The context is random token ids, prefilled once per
runner.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from bench_engine import alternate, tokens

from agentserve.executor.builtin import resolve_model
from agentserve.executor.runner import ModelRunner, PrefillChunk

# (name, cached tokens before the step, tokens in the step): react's resume (~56 tokens over ~3k) and cold chunks
STEPS = [("resume 56 after 3000", 3000, 56), ("chunk 256 after 0", 0, 256), ("chunk 256 after 2048", 2048, 256),
         ("chunk 256 after 3840", 3840, 256)]
BLOCK_SIZE = 16  # the engine's default


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bench", help="built-in model or checkpoint folder")
    p.add_argument("--settings", default="auto,torch", help="prefill_attention values, comma-separated")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (the prefill lane has one core of two)")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    settings = args.settings.split(",")
    length = max(start + n for _, start, n in STEPS)
    blocks = list(range(-(-length // BLOCK_SIZE)))
    runners = {s: ModelRunner(path, dtype="auto", device="cpu", num_blocks=len(blocks), block_size=BLOCK_SIZE,
                              prefill_attention=s) for s in settings}
    context = tokens(length, runners[settings[0]].config.vocab_size, seed=0)
    for runner in runners.values():
        for start in range(0, length, 512):
            runner.prefill([PrefillChunk(context[start : start + 512], start, blocks)])
    out = {"model": args.model, "threads": args.threads, "kernels": {
        s: r.prefill_attention or "torch" for s, r in runners.items()}, "steps": {}}
    for name, start, n in STEPS:
        chunk = [PrefillChunk(context[start : start + n], start, blocks)]
        steps = {s: (lambda r=r, chunk=chunk: r.prefill(chunk)) for s, r in runners.items()}
        medians = {s: t * 1e3 for s, t in alternate(steps, torch.device("cpu"), args.repeats, warmup=0).items()}
        out["steps"][name] = {"ms": medians, "over_first": {s: m / medians[settings[0]] for s, m in medians.items()}}
        print(f"{name}: " + ", ".join(f"{s} {m:.1f} ms" for s, m in medians.items()), file=sys.stderr)
    if args.json:
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
