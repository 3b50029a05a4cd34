"""Attention tests run the Triton kernels in Triton's CPU interpreter, on machines without CUDA.

``TRITON_INTERPRET`` must be set before Triton makes the kernels (when they are imported) and stay set while
they first launch (Triton imports its interpreter lazily), so it is set here, when pytest collects this
folder.  It holds for the whole test process, so on a machine with CUDA it is not set (and removed if the
environment set it): there it would take over the GPU tests' kernels too and read device memory as host memory
(seen on an H200: errors, then a segmentation fault).  There this folder's CPU tests are skipped — most of them
run Triton kernels on CPU tensors, which only the interpreter can — and the ``gpu``-marked ones run the kernels
for real.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

INTERPRETED = not torch.cuda.is_available()
if INTERPRETED:
    os.environ["TRITON_INTERPRET"] = "1"
else:
    os.environ.pop("TRITON_INTERPRET", None)
HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if INTERPRETED:
        return
    skip = pytest.mark.skip(reason="this folder's CPU tests run where CUDA is absent (Triton's CPU interpreter is "
                                   "off where it is: tests/attention/conftest.py); the gpu tests run here")
    for item in items:
        if item.path.parent == HERE and "gpu" not in item.keywords:
            item.add_marker(skip)
