"""``scripts/gpu_probe_attention.py --dry-run`` on a CPU walks every measurement path but the GPU's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "scripts" / "gpu_probe_attention.py"


@pytest.mark.slow
def test_dry_run_writes_one_line_per_measurement(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    planned = [line.strip() for line in proc.stdout.splitlines() if line.startswith("  ")]
    rows = [json.loads(line) for line in (tmp_path / "attention.jsonl").read_text().splitlines()]
    assert len(rows) == len(planned) > 0
    assert all(r["section"] == "attention" and r["dry_run"] for r in rows)
    decodes = [r for r in rows if r["kind"] == "decode"]
    assert {(r["backend"], r["graphs"]) for r in decodes} >= {("torch", False), ("triton", False), ("triton", True)}
    assert all(r["wall_ms_p50"] > 0 and "gpu_ms_p50" not in r for r in decodes)  # no GPU timing on a CPU
    assert {r["backend"] for r in rows if r["kind"] == "prefill"} >= {"torch", "triton"}
