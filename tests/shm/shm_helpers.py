"""Helpers of the shared-memory tests."""

from __future__ import annotations

import os

from agentserve.shm import segment as sg

SESSION = f"t{os.getpid()}"  # every run name of this test session starts with it


def ours(run_prefix: str = SESSION) -> list[str]:
    """Our /dev/shm entries (segments and semaphores) whose run starts with ``run_prefix``."""
    head = f"{sg.PREFIX}-{run_prefix}"
    return sg.list_segments(head) + sg.list_segments("sem." + head)
