"""Sections ``environment`` (what is installed, what the device is) and ``sm_resource`` (what the driver
says about SM partitions: minimum size, alignment, and how many groups each planned rung really gets)."""

from __future__ import annotations

import importlib
import os
import platform
import subprocess
from importlib import metadata
from typing import Any

from probe.common import CARRIED, Context

PACKAGES = ("torch", "triton", "cupy-cuda13x", "cuda-bindings", "numpy", "safetensors", "msgspec", "pyzmq",
            "posix-ipc", "pytest")


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "none"


def _nvidia_smi() -> str:
    query = "name,driver_version,memory.total,compute_cap,clocks.max.sm"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unavailable: {type(e).__name__}: {e}"
    return (out.stdout or out.stderr).strip()


def _device(index: int) -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"cuda": False}
    p = torch.cuda.get_device_properties(index)
    return {
        "cuda": True,
        "name": p.name,
        "sms": p.multi_processor_count,
        "capability": f"{p.major}.{p.minor}",
        "memory_gib": round(p.total_memory / 2**30, 2),
        "l2_mib": round(getattr(p, "L2_cache_size", 0) / 2**20, 1),
        "allocator_backend": torch.cuda.memory.get_allocator_backend(),
    }


def environment(ctx: Context, deadline: float) -> dict[str, Any]:
    """Versions, the device, whether the carried wheels import, and what ``agentserve doctor`` reports."""
    from agentserve.cli.doctor import report
    from agentserve.executor.partition.torch_cuda import device_index

    carried = {}
    for module in sorted(CARRIED):
        try:
            importlib.import_module(module)
            carried[module] = "ok"
        except ImportError as e:
            carried[module] = f"missing: {e}"
    doctor = report(device=device_index(ctx.device)) if not ctx.dry_run else report("cpu-cores")
    return {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "packages": {name: _version(name) for name in PACKAGES},
        "carried_imports": carried,
        "nvidia_smi": _nvidia_smi(),
        "device": _device(device_index(ctx.device)),
        "allocator_env": {k: os.environ.get(k, "") for k in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")},
        "doctor": {k: doctor[k] for k in ("backend", "partitioned", "reason", "ladder", "versions", "missing")},
    }


def _formable(drv: Any, resource: Any, size: int, total: int) -> dict[str, Any]:
    """How many groups of ``size`` the driver forms: simulated (result NULL) and asked for as many as fit."""
    from agentserve.executor.partition.driver import CudaCallError, call

    out: dict[str, Any] = {}
    for key, groups in (("simulated", 0), ("asked_max", max(1, total // size))):
        try:
            _, made, _ = call(drv, "cuDevSmResourceSplitByCount", groups, resource, 0, size)
            out[key] = int(made)
        except CudaCallError as e:
            out[key] = str(e)
    return out


def sm_resource(ctx: Context, deadline: float) -> dict[str, Any]:
    """The SM resource and, per planned rung, the split the driver really forms."""
    from agentserve.executor.partition.driver import call, load_driver
    from agentserve.executor.partition.green_ctx import read_granularity
    from agentserve.executor.partition.ladder import build_ladder
    from agentserve.executor.partition.sm_split import split_rung
    from agentserve.executor.partition.torch_cuda import TorchCuda, device_index

    drv = load_driver()
    call(drv, "cuInit", 0)
    index = device_index(ctx.device)
    dev = call(drv, "cuDeviceGet", index)
    resource = call(drv, "cuDeviceGetDevResource", dev, drv.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM)
    total = int(resource.sm.smCount)
    gran, gran_note = read_granularity(drv, dev, resource.sm)
    rungs = []
    for planned in build_ladder(total, gran)[:-1]:
        split, note = split_rung(drv, resource, planned.decode_units, total, gran)
        rungs.append({
            "planned_decode": planned.decode_units,
            "formed": None if split is None else [split.decode_sms, split.prefill_sms],
            "note": note,
            "groups_of_this_size": _formable(drv, resource, planned.decode_units, total),
        })
    ctx.found["cuda"] = TorchCuda(index)
    return {"total_sms": total, "granularity": gran_note, "rungs": rungs,
            "groups_of_min_size": _formable(drv, resource, gran.min_size, total)}


def sm_resource_dry(ctx: Context, deadline: float) -> dict[str, Any]:
    """The plan for an H200 (132 SMs, CC 9.0: min 8, steps of 8) — the driver query needs a GPU."""
    from agentserve.executor.partition.ladder import Granularity, build_ladder

    ladder = build_ladder(132, Granularity(8, 8, "compute-capability"))
    return {"would_query": "cuDeviceGetDevResource, one cuDevSmResourceSplitByCount per rung (+ simulated)",
            "planned_decode_sms_if_h200": [r.decode_units for r in ladder if r.partitioned]}
