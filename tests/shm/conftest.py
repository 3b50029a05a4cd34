"""Fixtures of the shared-memory tests: unique run names, and no leftovers in /dev/shm."""

from __future__ import annotations

import itertools
import os

import pytest

from agentserve.shm import segment as sg

_counter = itertools.count()
SESSION = f"t{os.getpid()}"


def ours(run_prefix: str = SESSION) -> list[str]:
    """Our /dev/shm entries (segments and semaphores) whose run starts with ``run_prefix``."""
    head = f"{sg.PREFIX}-{run_prefix}"
    return sg.list_segments(head) + sg.list_segments("sem." + head)


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
