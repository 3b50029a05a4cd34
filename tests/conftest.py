"""Project-wide test fixtures."""

from __future__ import annotations

import os

import pytest

SHM_DIR = "/dev/shm"


@pytest.fixture(autouse=True, scope="session")
def kernel_build_dir(tmp_path_factory):
    """The compiled CPU decode kernel is built into this session's temporary folder, not the user's cache
    (servers the tests start inherit the variable)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AGENTSERVE_KERNEL_DIR", str(tmp_path_factory.mktemp("kernels")))
        yield


def _our_segments() -> set[str]:
    if not os.path.isdir(SHM_DIR):
        return set()
    return {n for n in os.listdir(SHM_DIR) if "agentserve" in n}


@pytest.fixture(autouse=True, scope="module")
def no_leftover_shared_memory():
    """Every test module must leave /dev/shm as it found it: no segment or semaphore of ours stays behind.

    Module scope, so a server shared by a module's tests is checked after it stops; tests/shm checks
    each test on its own as well.
    """
    before = _our_segments()
    yield
    leaked = _our_segments() - before
    assert not leaked, f"test left shared-memory entries behind: {sorted(leaked)}"
