"""``agentserve doctor``: which partition backend this box gets and why, its ladder, and the versions."""

from __future__ import annotations

import json
import platform
from importlib import metadata
from typing import Any

import click

from agentserve.executor.partition import ORDER, detect
from agentserve.executor.partition.driver import CudaCallError, call, load_driver, version_str


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


def report(prefer: str | None = None) -> dict[str, Any]:
    backend = detect(prefer)
    try:
        info = backend.describe()
    finally:
        backend.close()
    info["versions"] = versions()
    return info


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
    shown = {k: v for k, v in info["versions"].items() if not k.endswith("_detail")}
    lines += [f"{name:<14}{value}" for name, value in shown.items()]
    return "\n".join(lines)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--partition", type=click.Choice(ORDER), default=None, help="Start detection at this backend.")
def doctor(as_json: bool, partition: str | None) -> None:
    """Show the partition backend chosen here and why, the device, its ladder, and versions."""
    info = report(partition)
    click.echo(json.dumps(info, indent=2) if as_json else render(info))
