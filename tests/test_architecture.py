"""Design-card rules that code review alone would not keep: the orchestrator side never loads torch."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import agentserve.orchestrator
import agentserve.shm


def _modules(package) -> list[str]:
    return [f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)]


def test_orchestrator_shm_client_and_up_never_import_torch() -> None:
    modules = [*_modules(agentserve.orchestrator), *_modules(agentserve.shm), "agentserve.client", "agentserve.cli.up"]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "from agentserve.executor.builtin import resolve_model\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"torch was imported: {out.stdout[:200]}"
