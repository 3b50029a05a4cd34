"""What every probe section shares: the run context, time budgets, summaries, the import check."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Import names of packages the device image has (BRIEF §8; the device's KINDS.md package list) that
# the probe's code imports directly; CARRIED travel as wheels listed in scripts/gpu_wheels.txt.
DEVICE_IMAGE = frozenset({
    "torch", "triton", "cupy", "cuda", "numpy", "safetensors", "tokenizers", "transformers", "jinja2", "rich",
    "click", "pytest", "hypothesis", "prometheus_client", "uvloop", "msgpack", "psutil", "yaml", "tqdm",
    "packaging", "filelock", "typing_extensions", "huggingface_hub",
})
OURS = frozenset({"agentserve", "probe", "lane_check", "bench_ring", "gpu_probe", "gpu_probe_attention"})
CARRIED = frozenset({"msgspec", "zmq", "posix_ipc", "llguidance", "starlette", "uvicorn"})


def foreign_imports(repo: Path) -> dict[str, list[str]]:
    """Top-level modules imported by the repo's loaded modules that are neither stdlib, ours, the device
    image's nor carried: name → the files importing it.  Read from the source (``ast``), so an import
    inside a function counts even when that function never ran here."""
    import ast
    import sys

    allowed = DEVICE_IMAGE | CARRIED | OURS | set(sys.stdlib_module_names) | {"__future__"}
    found: dict[str, list[str]] = {}
    files = {Path(m.__file__).resolve() for m in list(sys.modules.values())
             if getattr(m, "__file__", None) and Path(m.__file__).is_absolute()}
    root = repo.resolve()
    ours = [f for f in files if f.suffix == ".py" and root in f.parents and f.is_file()
            and not {"site-packages", ".venv"} & set(f.relative_to(root).parts)]
    for path in sorted(ours):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top not in allowed:
                    found.setdefault(top, []).append(str(path.relative_to(root)))
    return found


def stats_ms(xs: list[float]) -> dict[str, Any]:
    """n, p50, p95 and mean of ``xs`` seconds, in milliseconds (``lane_check.summary``'s shape)."""
    from lane_check import summary

    return summary(xs)


@dataclass
class Context:
    """One probe run: options, where to write, the deadline, and what earlier sections found."""

    out: Path
    dry_run: bool
    deadline: float
    repo: Path
    device: str = "cuda:0"
    found: dict[str, Any] = field(default_factory=dict)  # results by section name, for later sections

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def section_deadline(self, budget_s: float) -> float:
        return min(self.deadline, time.monotonic() + budget_s)


@dataclass
class Section:
    """A question with its measurement (``run``), its GPU-free walk (``dry``) and a time budget."""

    name: str
    question: str
    budget_s: float
    run: Callable[[Context, float], dict[str, Any]]
    dry: Callable[[Context, float], dict[str, Any]]


def write_line(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line (the file is the probe's result; nothing is ever rewritten)."""
    with path.open("a") as f:
        f.write(json.dumps(record, default=str) + "\n")


class Budget:
    """A loop's end: ``while budget.more():`` stops at the section's deadline, recording that it did."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.cut = False

    def more(self) -> bool:
        if time.monotonic() < self.deadline:
            return True
        self.cut = True
        return False
