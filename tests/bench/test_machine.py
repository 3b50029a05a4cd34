"""The machine a report records: CPU model and SIMD flags parsed from /proc/cpuinfo text, GPUs from the driver."""

from __future__ import annotations

from agentserve.bench import machine

X86 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9654 96-Core Processor
flags\t\t: fpu sse4_2 avx f16c fma hypervisor avx2 avx512f avx512_vnni amx_tile sha_ni
processor\t: 1
model name\t: something else
flags\t\t: fpu
"""
ARM = """processor\t: 0
Features\t: fp asimd evtstrm aes sve sve2 asimddp
CPU implementer\t: 0x41
"""


def test_cpu_model_and_simd_flags_of_the_first_processor():
    info = machine.cpu_info(X86)
    assert info["cpu_model"] == "AMD EPYC 9654 96-Core Processor"
    assert info["cpu_flags"] == ["amx_tile", "avx2", "avx512_vnni", "avx512f", "f16c", "fma", "hypervisor"]
    arm = machine.cpu_info(ARM)
    assert arm["cpu_model"] is None and arm["cpu_flags"] == ["asimd", "asimddp", "sve", "sve2"]


def test_gpu_models_from_the_driver_folder(tmp_path):
    assert machine.gpu_models(tmp_path / "absent") == []
    (tmp_path / "0000:01:00.0").mkdir()
    (tmp_path / "0000:01:00.0" / "information").write_text("Model: \t NVIDIA H200\nIRQ: 1\n")
    assert machine.gpu_models(tmp_path) == ["NVIDIA H200"]


def test_one_line_says_what_was_not_recorded():
    line = machine.one_line({"cpu_model": "X", "cpu_flags": ["avx2"], "cpus": 2, "machine": "x86_64", "gpus": []})
    assert line == "X (2 logical CPUs, x86_64; avx2); no GPU"
    assert "CPU model not recorded" in machine.one_line({}) and "flags not recorded" in machine.one_line({})
    described = machine.describe()
    assert {"cpu_model", "cpu_flags", "cpus", "gpus", "loadavg_1_5_15"} <= set(described)
