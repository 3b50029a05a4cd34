"""The device probe's ``--dry-run`` on this CPU machine: every section walks its GPU-free path and says
what it would measure, and nothing it loads imports a package the device image lacks (unless carried)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ["environment", "sm_resource", "sm_map", "events_graph", "gemm_lanes", "physics", "model", "attention",
            "memory", "ring", "pytest_gpu"]


def _probe(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_probe.py"), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def test_probe_lists_its_sections() -> None:
    done = _probe("--list")
    assert done.returncode == 0, done.stderr
    assert [line.split()[0] for line in done.stdout.splitlines()] == SECTIONS


@pytest.mark.slow
def test_dry_run_walks_every_section_on_a_cpu_machine(tmp_path: Path) -> None:
    done = _probe("--dry-run", "--out", str(tmp_path), timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "probe.jsonl").read_text().splitlines()]
    assert [r["section"] for r in records] == [*SECTIONS, "imports"]
    assert all(r["status"] == "ok" and r.get("dry_run", True) for r in records), records
    assert records[-1]["foreign"] == {}, "the probe imports something the device image lacks"
    model = next(r["result"] for r in records if r["section"] == "model")
    assert model["gpu_model_parameters"] > 1.2e9 and model["rungs"], "the measurement code ran on the CPU"
    assert "msgs_per_s" in json.dumps(next(r["result"] for r in records if r["section"] == "ring"))
    assert (tmp_path / "summary.txt").read_text().splitlines()[0].startswith("section")
    for name in SECTIONS:
        assert name in done.stdout


def test_carried_wheels_are_the_probe_allowlist() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from probe.common import CARRIED
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    lines = [ln for ln in (ROOT / "scripts" / "gpu_wheels.txt").read_text().splitlines() if ln and ln[0] != "#"]
    names = {ln.split("==")[0] for ln in lines}
    assert all("==" in ln for ln in lines), "every carried wheel is pinned"
    import_names = {"msgspec": "msgspec", "pyzmq": "zmq", "posix-ipc": "posix_ipc", "llguidance": "llguidance",
                    "starlette": "starlette", "uvicorn": "uvicorn"}
    assert {import_names[n] for n in names} == set(CARRIED)
