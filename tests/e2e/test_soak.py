"""``scripts/soak.py`` for half a minute: every kind of fault once, nothing lost, hung or leaked."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_short_soak_with_every_fault_loses_and_leaks_nothing(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "soak.py"), "--minutes", "0.6", "--agents", "3",
           "--fault-every", "6", "--event-timeout", "30", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    report = json.loads(out.read_text())
    shutil.rmtree(Path(report["log"]).parent)  # the script keeps its folder for its log; a test run leaves nothing
    summary = {k: report[k] for k in ("turns_done", "lost_turns", "hung_turns", "leaked_blocks", "leaked_segments")}
    assert proc.returncode == 0, (summary, proc.stdout[-2000:], proc.stderr[-2000:])
    assert {f["fault"] for f in report["faults"]} == {
        "client_kill", "client_freeze", "executor_kill", "executor_hang", "bad_frames"
    }
    assert report["turns_done"] > 10 and report["exit_code"] == 0
