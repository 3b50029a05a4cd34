"""Probe section ``attention``: decode and prefill per attention backend, eager vs CUDA graphs, on the ~1B model.

The measurements live in ``scripts/gpu_probe_attention.py`` (runnable on its own); this section runs them
inside the probe's run and budget, and the dry run lists what they would be (that script's own
``--dry-run``, which walks its code in Triton's CPU interpreter, is tested in ``tests/attention``).
"""

from __future__ import annotations

from typing import Any

from probe.common import Context


def attention(ctx: Context, deadline: float) -> dict[str, Any]:
    import gpu_probe_attention as ga

    records = ga.run(ctx.out)
    return {"measurements": len(records), "file": str(ctx.out / "attention.jsonl"),
            "summary": ga.summary(records).splitlines()}


def attention_dry(ctx: Context, deadline: float) -> dict[str, Any]:
    import gpu_probe_attention as ga

    settings = ga.device_settings()
    settings.backends = ["torch", "triton", "flashinfer (when carried)"]
    return {"would_measure": ga.plan(settings)}
