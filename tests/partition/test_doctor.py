"""``agentserve doctor``: the backend, why, the ladder and the versions, as text and as JSON."""

from __future__ import annotations

import json
import os
import re

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


def test_doctor_on_a_gpu_box_makes_green_contexts_after_the_primary_context() -> None:
    from partition_fakes import Gpu

    from agentserve.cli.doctor import report

    gpu = Gpu(132, (9, 0))
    info = report(driver=gpu.drv, cuda=gpu.cuda)
    assert info["backend"] == "green-ctx" and info["partitioned"]
    assert not gpu.violations
    assert not gpu.drv.live_contexts and not gpu.drv.live_streams


def test_doctor_says_what_is_missing_and_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from agentserve.cli import doctor as doc
    from agentserve.executor.partition.driver import CudaCallError

    def no_bindings():
        raise CudaCallError("import cuda.bindings.driver", "failed: ModuleNotFoundError: No module named 'cuda'")

    monkeypatch.setattr(doc, "load_driver", no_bindings)
    monkeypatch.setattr(doc, "_package_version", lambda name: "none")
    missing = doc.missing(doc.versions())
    fixes = " | ".join(m["fix"] for m in missing)
    assert any(m["what"].startswith("cuda-python") for m in missing), missing
    assert "pip install 'cuda-python" in fixes
    if torch.version.cuda is None:
        assert any("CPU build" in m["what"] for m in missing) and "download.pytorch.org/whl" in fixes
    result = CliRunner().invoke(doctor, ["--partition", "cpu-cores"])
    assert "missing" in result.output and "pip install 'cuda-python" in result.output


def test_doctor_flags_bindings_newer_than_the_driver() -> None:
    from agentserve.cli.doctor import missing

    found = missing({"python": "3.12", "torch": "2.11.0+cu128", "torch_cuda": "12.8", "cuda_driver": "12.8",
                     "cuda_bindings": "13.0.1"})
    assert [m["what"] for m in found] == ["cuda-bindings 13.0.1 is newer than the driver's CUDA 12.8"]
    assert "<13" in found[0]["fix"]
    assert missing({"python": "3.12", "torch": "2.11.0+cu130", "torch_cuda": "13.0", "cuda_driver": "13.0",
                    "cuda_bindings": "13.0.1"}) == []


def test_doctor_names_the_cpu_engine_auto_runs_on_this_cpu_class(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both CPU classes, whichever this machine is: native bf16 → hybrid matrices, else packed fp16."""
    from agentserve.cli import doctor as doctor_module
    from agentserve.executor import linear
    from agentserve.executor.attention import cpu_prefill

    for native, words in ((True, "hybrid matrices"), (False, "packed fp16 matrices")):
        monkeypatch.setattr(linear, "cpu_has_fast_bf16", lambda native=native: native)
        monkeypatch.setattr(linear, "fp16_packing_available", lambda: True)
        engine = doctor_module.cpu_engine()
        assert words in engine
        if native:  # what a hybrid matrix's decode reads follows the decode step that runs
            fused = "fused C decode step" in engine
            assert not fused or re.search(r"fused C decode step \((AVX-512|AVX2)\)", engine), engine
            assert ("bf16 values with fp32 sums for decode" in engine) == fused
            assert ("packed fp16 for decode" in engine) == (not fused)
            assert ("with a helper thread" in engine) == (fused and len(os.sched_getaffinity(0)) > 1)
        bf16_attention = native and cpu_prefill.load("bf16") is not None  # the kernel needs AVX512-BF16 itself
        fp32_kernel = not bf16_attention and cpu_prefill.preferred()  # builds without AVX-512 take it
        assert ("bf16 prefill attention" in engine) == bf16_attention
        assert ("fp32 prefill attention (compiled, AVX2)" in engine) == fp32_kernel
        assert ("fp32 prefill attention (PyTorch)" in engine) == (not bf16_attention and not fp32_kernel)
    from agentserve.executor import attention

    for amx in (True, False):  # AMX tiles: PyTorch's bf16 attention, whatever this CPU is
        monkeypatch.setattr(linear, "cpu_has_fast_bf16", lambda: True)
        monkeypatch.setattr(attention, "cpu_has_amx", lambda amx=amx: amx)
        assert ("bf16 prefill attention (PyTorch, AMX)" in doctor_module.cpu_engine()) == amx
    result = CliRunner().invoke(doctor, ["--partition", "cpu-cores"])
    assert "cpu engine  fp32 activations" in result.output
