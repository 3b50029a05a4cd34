"""``agentserve doctor``: which partition backend this box gets and why, its ladder, the versions, and
what the GPU path is missing here with the command that gets it."""

from __future__ import annotations

import json
import os
import platform
import sys
from importlib import metadata
from typing import Any

import click

from agentserve.executor.partition import ORDER, detect
from agentserve.executor.partition.driver import CudaCallError, call, load_driver, version_str

GREEN_MIN = (12, 4)  # green contexts need a driver for CUDA 12.4 (R550) or newer
TORCH_WHEELS = "https://download.pytorch.org/whl/cu128 (or the cuXYZ your driver supports)"


def _package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "none"


def cuda_driver_version() -> tuple[str, str]:
    """(version, detail): the driver's CUDA version, or ``"none"`` and why."""
    try:
        return version_str(int(call(load_driver(), "cuDriverGetVersion"))), ""
    except CudaCallError as e:
        return "none", str(e)


def versions() -> dict[str, str]:
    import torch

    driver, detail = cuda_driver_version()
    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda or "none",
        "cuda_driver": driver,
        "cuda_bindings": _package_version("cuda-bindings"),
    }
    if detail:
        out["cuda_driver_detail"] = detail
    return out


def _major_minor(version: str) -> tuple[int, int] | None:
    parts = version.split("+", 1)[0].split(".")
    try:
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        return None


def missing(v: dict[str, str]) -> list[dict[str, str]]:
    """What the GPU path lacks here, each with the command or step that gets it (empty: nothing)."""
    out: list[dict[str, str]] = []
    if v["torch_cuda"] == "none":
        out.append({"what": f"torch {v['torch']} is a CPU build",
                    "fix": f"pip install torch --index-url {TORCH_WHEELS}"})
    driver = _major_minor(v["cuda_driver"])
    bindings = _major_minor(v["cuda_bindings"])
    if bindings is None:
        pin = f",<{driver[0] + 1}" if driver and driver[0] < 13 else ""
        out.append({"what": "cuda-python (cuda-bindings) is not installed: no green contexts without it",
                    "fix": f"pip install 'cuda-python>=12.4{pin}'"})
    elif driver is None:
        detail = v.get("cuda_driver_detail", "")
        out.append({"what": f"no NVIDIA driver answered ({detail})" if detail else "no NVIDIA driver answered",
                    "fix": "install the NVIDIA driver (R550 or newer for green contexts) on a machine with a GPU"})
    elif bindings[0] > driver[0]:
        out.append({"what": f"cuda-bindings {v['cuda_bindings']} is newer than the driver's CUDA {v['cuda_driver']}",
                    "fix": f"pip install 'cuda-python>=12.4,<{driver[0] + 1}' (or upgrade the driver)"})
    if driver is not None and driver < GREEN_MIN:
        out.append({"what": f"the driver supports CUDA {v['cuda_driver']}; green contexts need 12.4",
                    "fix": "upgrade the NVIDIA driver to R550 or newer"})
    return out


def report(prefer: str | None = None, *, device: int = 0, driver: Any = None, cuda: Any = None) -> dict[str, Any]:
    """Detect the backend (seams ``driver``/``cuda`` for tests), describe it, close it; add versions and gaps."""
    from agentserve.executor.partition.torch_cuda import TorchCuda

    backend = detect(prefer, driver=driver, cuda=cuda or TorchCuda(device))
    try:
        info = backend.describe()
    finally:
        backend.close()
    info["versions"] = versions()
    info["missing"] = missing(info["versions"])
    info["cpu_engine"] = cpu_engine()
    return info


def cpu_engine() -> str:
    """What ``dtype = auto`` and ``weights = auto`` run on this CPU for a bf16 checkpoint, and why."""
    import torch

    from agentserve.executor.attention import cpu_decode_kernel, cpu_prefill_kernel, torch_prefill_dtype
    from agentserve.executor.fused.step import instruction_set
    from agentserve.executor.fused.step import why_not as fused_why_not
    from agentserve.executor.linear import choose_format, onednn_blocking_available
    from agentserve.executor.runner import resolve_kv_dtype

    cpu, fp32 = torch.device("cpu"), torch.float32
    fmt = choose_format("auto", torch.bfloat16, torch.zeros(1, 1))  # the engine's own choices, for the `bench` shape
    kernel, _ = cpu_decode_kernel("auto", 8, 2, 64, 16, cpu, fp32)
    kv = resolve_kv_dtype("auto", cpu, fp32, [fmt], kernel is not None and kernel.reads_f16)
    cache = ("an fp16 KV cache (compiled decode-attention kernel)" if kv == torch.float16
             else "an fp32 KV cache")
    fused = fmt != "dense" and not fused_why_not("auto", kernel, cpu, fp32, ())  # fmt stands for the matrices
    cache += f", fused C decode step ({instruction_set(kernel)})" if fused else ", PyTorch decode step"
    if fused and len(os.sched_getaffinity(0)) > 1:
        cache += " shared with a helper thread on the prefill lane's idle core"
    hybrid_decode = ("the checkpoint's bf16 values with fp32 sums for decode" if fused
                     else "packed fp16 for decode")  # the fused step reads a hybrid matrix's bf16 copy
    prefill, _ = cpu_prefill_kernel("auto", "auto", 8, 2, 64, 16, cpu, fp32, fmt == "hybrid")
    amx = torch_prefill_dtype("auto", cpu, fp32, fmt == "hybrid") is not None
    cache += {None: ", fp32 prefill attention (PyTorch)", "bf16": ", bf16 prefill attention (compiled, AVX512-BF16)",
              "fp32": ", fp32 prefill attention (compiled, AVX2)",
              "amx": ", bf16 prefill attention (PyTorch, AMX)"}["amx" if amx else prefill and prefill.variant]
    blocked = "; from oneDNN-blocked copies where they fit" if onednn_blocking_available() else ""
    return {
        "dense": "fp32 activations, dense fp32 matrices (no FBGEMM fp16 kernel in this build/CPU)",
        "hybrid": f"fp32 activations, hybrid matrices: bf16 products for prefill chunks (native bf16{blocked}), "
                  f"{hybrid_decode}",
        "fp16": "fp32 activations, packed fp16 matrices (no native bf16)",
    }[fmt] + f", {cache}"


def render(info: dict[str, Any]) -> str:
    unit = info["unit"]
    lines = [
        f"backend     {info['backend']} ({'partitioned' if info['partitioned'] else 'not partitioned'})",
        f"device      {info['device']}",
        "why         " + "\n            ".join(info["reason"].split("; ")),
        f"ladder      rung  decode {unit:<6} prefill {unit}",
    ]
    for r in info["ladder"]:
        shared = "" if r["partitioned"] else "   (shared, not partitioned)"
        lines.append(f"            {r['rung']:>4}  {r['decode']:>12}  {r['prefill']:>13}{shared}")
    lines.append(f"cpu engine  {info['cpu_engine']}")
    shown = {k: v for k, v in info["versions"].items() if not k.endswith("_detail")}
    lines += [f"{name:<14}{value}" for name, value in shown.items()]
    gaps = info.get("missing", [])
    lines.append("missing     " + ("nothing for the GPU path" if not gaps else gaps[0]["what"]))
    for i, gap in enumerate(gaps):
        if i:
            lines.append(f"            {gap['what']}")
        lines.append(f"              → {gap['fix']}")
    return "\n".join(lines)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--partition", type=click.Choice(ORDER), default=None, help="Start detection at this backend.")
@click.option("--device", default="cuda:0", show_default=True, help="The CUDA device to inspect (cuda:N).")
def doctor(as_json: bool, partition: str | None, device: str) -> None:
    """Show the partition backend chosen here and why, the device, its ladder, versions, and what is missing."""
    from agentserve.executor.partition.torch_cuda import device_index

    try:
        index = device_index(device)
    except RuntimeError:  # torch's "Invalid device string" and the like
        click.echo(f"agentserve doctor: --device must be cuda or cuda:N (N >= 0), got {device!r}", err=True)
        sys.exit(2)
    info = report(partition, device=index)
    click.echo(json.dumps(info, indent=2) if as_json else render(info))
