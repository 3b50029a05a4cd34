"""``agentserve doctor``: the backend, why, the ladder and the versions, as text and as JSON."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from agentserve.cli.doctor import doctor

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


@needs_no_cuda
def test_doctor_json_reports_cpu_cores_with_reason_and_ladder() -> None:
    result = CliRunner().invoke(doctor, ["--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["backend"] == "cpu-cores" and info["unit"] == "cores"
    assert "green-ctx unavailable" in info["reason"] and "cuda-streams unavailable" in info["reason"]
    ladder = info["ladder"]
    assert ladder[-1]["partitioned"] is False and ladder[-1]["decode"] == ladder[-1]["prefill"]
    assert all(r["decode"] + r["prefill"] == ladder[-1]["decode"] for r in ladder if r["partitioned"])
    assert info["versions"]["torch"] == torch.__version__
    assert info["versions"]["cuda_driver"] == "none"
    assert set(info["versions"]) >= {"python", "torch", "cuda_driver", "cuda_bindings"}


def test_doctor_text_lists_every_rung() -> None:
    result = CliRunner().invoke(doctor, ["--partition", "cpu-cores"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("backend     cpu-cores")
    rows = [
        line for line in result.output.splitlines() if line.startswith("            ") and line.strip()[0].isdigit()
    ]
    assert len(rows) >= 1 and "shared, not partitioned" in rows[-1]
    assert "cuda_bindings" in result.output


def test_doctor_rejects_unknown_backend() -> None:
    result = CliRunner().invoke(doctor, ["--partition", "mps"])
    assert result.exit_code != 0
