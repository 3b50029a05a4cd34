"""Fixtures of the shared-memory tests: unique run names, and no leftovers in /dev/shm."""

from __future__ import annotations

import itertools

import pytest
from shm_helpers import SESSION, ours

from agentserve.shm import segment as sg

_counter = itertools.count()


@pytest.fixture
def run() -> str:
    """A run name no other test (or other test session on this machine) uses."""
    return f"{SESSION}x{next(_counter)}"


@pytest.fixture(autouse=True)
def no_leftovers():
    """After every test no /dev/shm entry of this session's runs may remain (then remove them)."""
    yield
    left = ours()
    for entry in left:  # do not let one leak fail every later test
        name = "/" + entry.removeprefix("sem.")
        try:
            if entry.startswith("sem."):
                sg.posix_ipc.unlink_semaphore(name)
            else:
                sg.posix_ipc.unlink_shared_memory(name)
        except sg.posix_ipc.ExistentialError:
            pass
    assert not left, f"test left shared-memory entries behind: {left}"
