"""The wheel must carry every module of every mapped folder, the configs, and the C sources the CPU library is
built from on first use (without them an installed engine silently decodes on the PyTorch path)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAPPED = {"protocol", "orchestrator", "executor", "shm", "cli", "client", "bench", "configs", "gateway"}


def _source_files() -> set[str]:
    out = set()
    for folder in MAPPED:
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".toml", ".c", ".h") and "__pycache__" not in path.parts:
                out.add("agentserve/" + path.relative_to(ROOT).as_posix())
    return out


def _tracked_copy(dest: Path) -> Path:
    """The files git tracks, copied to ``dest``: a build there cannot pick up a stale ``build/`` of the work tree
    (which would hide a file the package data no longer names).  Without git: the work tree itself."""
    try:
        listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return ROOT
    for name in filter(None, listed.decode().split("\0")):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


@pytest.mark.slow
def test_wheel_carries_every_module(tmp_path: Path) -> None:
    source = _tracked_copy(tmp_path / "src")
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path), str(source)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("agentserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = _source_files() - names
    assert not missing, f"wheel lacks: {sorted(missing)}"
    assert "agentserve/executor/__init__.py" in names
    assert {"agentserve/executor/attention/paged_decode.c", "agentserve/executor/attention/paged_prefill.c",
            "agentserve/executor/attention/paged_prefill_fp32.c", "agentserve/executor/attention/paged_prefill.h",
            "agentserve/executor/attention/simd_math.h", "agentserve/executor/fused/decode_step.c"} <= names


def test_every_python_folder_is_mapped() -> None:
    """A new package folder must be added to pyproject's package map, or the wheel silently drops it."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped_dirs = set(config["package-dir"].values())
    for init in ROOT.rglob("__init__.py"):
        rel = init.parent.relative_to(ROOT).as_posix()
        if rel.split("/")[0] in MAPPED:
            assert rel in mapped_dirs, f"{rel} has an __init__.py but is not in pyproject's package-dir"
