"""The README's set-up command gives a GPU box the driver bindings green contexts need."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cuda_python_is_a_main_dependency_where_it_has_wheels() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    cuda = [d for d in project["dependencies"] if d.startswith("cuda-python")]
    assert len(cuda) == 1, project["dependencies"]
    spec, marker = (part.strip() for part in cuda[0].split(";"))
    assert spec == "cuda-python>=12.4"
    assert "linux" in marker and "win32" in marker and "darwin" not in marker.lower()
