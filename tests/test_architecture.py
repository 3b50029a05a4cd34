"""The design card's layers, checked on every import statement (module level and inside functions).

- ``protocol/`` (the contracts) imports nothing of AgentServe but itself;
- ``shm/`` (transport) imports only the contracts;
- ``client/`` imports only the contracts;
- ``orchestrator/`` never imports torch or the executor;
- ``executor/`` never imports the orchestrator;
- ``gateway/`` (the HTTP front, an SDK client) imports only itself, the client, the contracts, the
  torch-free text tools of the orchestrator and the log format every process shares (``configs.logging``).

And at run time: importing the orchestrator side (and ``agentserve up``) never loads torch.
"""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import agentserve.gateway
import agentserve.orchestrator
import agentserve.protocol
import agentserve.shm

ROOT = Path(__file__).resolve().parent.parent

# folder → (AgentServe packages it may import; third-party roots it must not import)
RULES: dict[str, tuple[tuple[str, ...] | None, tuple[str, ...]]] = {
    "protocol": (("agentserve.protocol",), ("torch",)),
    "shm": (("agentserve.shm", "agentserve.protocol"), ("torch",)),
    "client": (("agentserve.client", "agentserve.protocol"), ("torch",)),
    "orchestrator": (None, ("torch", "agentserve.executor")),
    "executor": (None, ("agentserve.orchestrator",)),
    "gateway": (
        ("agentserve.gateway", "agentserve.client", "agentserve.protocol", "agentserve.orchestrator.text",
         "agentserve.configs.logging"),
        ("torch",),
    ),
}


def imported_modules(path: Path, package: str) -> list[tuple[int, str]]:
    """Every module an import statement in ``path`` names, relative imports resolved against ``package``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out += [(node.lineno, f"{base}.{alias.name}" if node.module is None else base) for alias in node.names]
    return out


def _package_of(path: Path) -> str:
    return ".".join(("agentserve", *path.relative_to(ROOT).parts[:-1]))


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def layer_violations(folder: str) -> list[str]:
    allowed, forbidden = RULES[folder]
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for line, module in imported_modules(path, _package_of(path)):
            own = module.startswith("agentserve.") or module == "agentserve"
            if _under(module, forbidden) or (allowed is not None and own and not _under(module, allowed)):
                found.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return found


@pytest.mark.parametrize("folder", sorted(RULES))
def test_layers(folder: str) -> None:
    violations = layer_violations(folder)
    assert not violations, f"{folder}/ breaks its layer rule:\n" + "\n".join(violations)


def test_the_rule_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    """The checker itself: an import inside a function and a relative import are both seen."""
    source = tmp_path / "mod.py"
    source.write_text("from .ring import Ring\ndef f():\n    from agentserve.orchestrator import server\n")
    modules = [m for _, m in imported_modules(source, "agentserve.shm")]
    assert modules == ["agentserve.shm.ring", "agentserve.orchestrator"]


def test_orchestrator_shm_client_gateway_and_up_never_import_torch() -> None:
    modules = [
        *(m.name for m in pkgutil.walk_packages(agentserve.orchestrator.__path__, "agentserve.orchestrator.")),
        *(m.name for m in pkgutil.walk_packages(agentserve.shm.__path__, "agentserve.shm.")),
        *(m.name for m in pkgutil.walk_packages(agentserve.protocol.__path__, "agentserve.protocol.")),
        *(m.name for m in pkgutil.walk_packages(agentserve.gateway.__path__, "agentserve.gateway.")
          if m.name != "agentserve.gateway.__main__"),
        "agentserve.client",
        "agentserve.cli.up",
    ]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "from agentserve.executor.builtin import resolve_model\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"torch was imported: {out.stdout[:200]}"
    assert len(modules) > 30  # the walk found the sub-packages
