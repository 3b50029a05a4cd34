"""The executor's CUDA allocator: PyTorch's caching allocator by default; the cudaMallocAsync backend
(one stream-ordered pool per device) only when asked, and then without decode CUDA graphs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from agentserve.executor import process
from agentserve.executor.memory import SHARED_POOL, configure_cuda_allocator


def test_caching_allocator_is_the_default() -> None:
    env: dict[str, str] = {}
    assert configure_cuda_allocator(env) == "native"
    assert env == {}


def test_shared_pool_on_request() -> None:
    """Through the old variable name: the only one torch 2.9-2.11 reads CUDA-only keys from (pytorch#183387)."""
    env = {"AGENTSERVE_CUDA_ALLOCATOR": "shared"}
    assert configure_cuda_allocator(env) == "cudaMallocAsync"
    assert env == {"AGENTSERVE_CUDA_ALLOCATOR": "shared", "PYTORCH_CUDA_ALLOC_CONF": SHARED_POOL}


@pytest.mark.parametrize("var", ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"])
def test_a_users_allocator_setting_wins(var: str) -> None:
    env = {var: "expandable_segments:True"}
    assert configure_cuda_allocator(env) == "user"
    assert env == {var: "expandable_segments:True"}


def test_an_unknown_allocator_is_refused() -> None:
    with pytest.raises(ValueError, match="AGENTSERVE_CUDA_ALLOCATOR"):
        configure_cuda_allocator({"AGENTSERVE_CUDA_ALLOCATOR": "slab"})


def test_executor_chooses_the_allocator_before_torch_loads(tmp_path) -> None:
    """torch 2.11 fixes the allocator backend when it is imported; the executor's entry point must set it first.

    An import hook records PYTORCH_CUDA_ALLOC_CONF at the moment torch is first imported, while the entry point
    runs as ``python -m agentserve.executor --help`` does (it imports everything, then argparse exits)."""
    probe = (
        "import os, sys, runpy, importlib.abc\n"
        "seen = []\n"
        "class Watch(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' and not seen:\n"
        "            seen.append(os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))\n"
        "        return None\n"
        "sys.meta_path.insert(0, Watch())\n"
        "import agentserve.executor.__main__\n"
        "assert 'torch' not in sys.modules and 'PYTORCH_CUDA_ALLOC_CONF' not in os.environ, 'import chose'\n"
        "sys.argv = ['python -m agentserve.executor', '--help']\n"
        "try:\n"
        "    runpy.run_module('agentserve.executor', run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('SEEN', seen[0])\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF",
                                                              "AGENTSERVE_CUDA_ALLOCATOR")}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         env={**env, "AGENTSERVE_CUDA_ALLOCATOR": "shared"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == ["SEEN", SHARED_POOL]


def test_a_refused_allocator_setting_reaches_the_orchestrator(monkeypatch) -> None:
    """A bad AGENTSERVE_CUDA_ALLOCATOR is a fatal ExecError once the rings are attached (``agentserve up`` prints
    it), not a traceback before them."""
    from agentserve.executor.__main__ import choose_allocator, parse

    monkeypatch.setenv("AGENTSERVE_CUDA_ALLOCATOR", "slab")
    allocator, error = choose_allocator()
    assert allocator == "" and "AGENTSERVE_CUDA_ALLOCATOR='slab'" in error
    opts, _ = parse(["--run", "r", "--model", "m"], allocator, error)
    sent: list = []
    monkeypatch.setattr(process.RingPair, "attach", staticmethod(lambda run, role: type("P", (), {
        "send": lambda self, m, timeout=None: sent.append(m), "close": lambda self: None})()))
    monkeypatch.setattr(process.signal, "signal", lambda *a: None)
    assert process.run_executor(opts) == 2
    assert len(sent) == 1 and sent[0].fatal and "use shared or native" in sent[0].message


@pytest.mark.parametrize(("env", "graphs"), [
    ({}, "auto"),
    ({"PYTORCH_CUDA_ALLOC_CONF": SHARED_POOL}, "off"),
    ({"PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync,expandable_segments:False"}, "off"),
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, "auto"),
])
def test_decode_graphs_are_off_under_the_shared_pool(monkeypatch, env, graphs) -> None:
    """Triton's kernels cannot be captured into CUDA graphs over cudaMallocAsync memory (seen on an H200)."""
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert process.runner_options({"dtype": "bfloat16"}).get("cuda_graphs", "auto") == graphs
    assert process.runner_options({"cuda_graphs": "off"})["cuda_graphs"] == "off"
