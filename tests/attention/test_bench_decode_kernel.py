"""``scripts/bench_decode_kernel.py``: times the built decode kernel against other versions of its source, and refuses
a version whose output differs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentserve.executor.attention import cpu_kernel
from agentserve.executor.kernels import build

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "scripts" / "bench_decode_kernel.py"
SOURCE = Path(cpu_kernel.__file__).parent / "paged_decode.c"
SMALL = ["--context", "150", "--shared", "64", "--layers", "2", "--repeats", "1"]

pytestmark = pytest.mark.skipif(build.compiler() is None, reason="no C compiler on this machine")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *SMALL, *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT / "scripts")


def test_times_every_case_for_the_built_kernel_and_a_copy_of_its_source(tmp_path):
    copy = tmp_path / "paged_decode.c"
    copy.write_text(SOURCE.read_text())
    done = run("--compare", str(copy), "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    ms = json.loads(done.stdout)["ms"]
    assert len(ms) == 3 and all(set(t) == {"built", str(copy)} and min(t.values()) > 0 for t in ms.values())


def test_a_version_that_computes_something_else_is_refused(tmp_path):
    wrong = tmp_path / "paged_decode.c"
    text = SOURCE.read_text()
    assert "const float inv = 1.0f / l[i];" in text
    wrong.write_text(text.replace("const float inv = 1.0f / l[i];", "const float inv = 2.0f / l[i];"))
    done = run("--compare", str(wrong))
    assert done.returncode != 0 and "differs from the built kernel" in done.stderr
