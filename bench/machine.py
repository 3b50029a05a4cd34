"""What a benchmark ran on: CPU model and SIMD flags (from ``/proc/cpuinfo``), cores, GPUs, load.

Recorded in every report's ``meta`` so a figure is never read without its machine class; the paper
report quotes these fields as they were recorded, never the machine that renders the report.
"""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path
from typing import Any

# the instruction-set flags that change the speed of the CPU kernels (x86 and Arm spellings)
SIMD_FLAG = re.compile(r"^(avx2|avx512\w*|amx\w*|avx_vnni\w*|fma|f16c|asimd\w*|sve\w*|neon)$")


def cpu_info(text: str) -> dict[str, Any]:
    """CPU model name and its SIMD flags, from the text of ``/proc/cpuinfo`` (first processor)."""
    model, flags = None, []
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model", "hardware") and model is None:
            model = value.strip() or None
        elif key in ("flags", "features") and not flags:
            words = value.split()
            flags = sorted(w for w in words if SIMD_FLAG.match(w))
            if "hypervisor" in words:
                flags.append("hypervisor")
    return {"cpu_model": model, "cpu_flags": flags}


def gpu_models(root: Path = Path("/proc/driver/nvidia/gpus")) -> list[str]:
    """NVIDIA GPU model names the driver lists (empty without a driver); read without importing torch."""
    out = []
    for info in sorted(root.glob("*/information")) if root.is_dir() else []:
        for line in info.read_text(errors="replace").splitlines():
            if line.lower().startswith("model:"):
                out.append(line.split(":", 1)[1].strip())
    return out


def describe() -> dict[str, Any]:
    """This machine: CPU model and flags, logical CPUs, GPUs, OS, load average (1, 5, 15 min)."""
    try:
        cpu = cpu_info(Path("/proc/cpuinfo").read_text(errors="replace"))
    except OSError:
        cpu = {"cpu_model": platform.processor() or None, "cpu_flags": []}
    return {"machine": platform.machine(), "platform": platform.platform(), "cpus": os.cpu_count(), **cpu,
            "gpus": gpu_models(), "loadavg_1_5_15": list(os.getloadavg())}


def one_line(meta: dict[str, Any]) -> str:
    """The machine of a report's ``meta`` in one line ("not recorded" for what the report lacks)."""
    cpu = meta.get("cpu_model") or "CPU model not recorded"
    flags = " ".join(meta.get("cpu_flags") or []) or "flags not recorded"
    gpus = ", ".join(meta.get("gpus") or []) or "no GPU"
    cores = meta.get("cpus")
    return f"{cpu} ({cores if cores is not None else '?'} logical CPUs, {meta.get('machine', '?')}; {flags}); {gpus}"
