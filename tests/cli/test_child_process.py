"""Children that die with their parent (cli/child_process.py): the parent-death signal, and a parent that died
before the child asked for it."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest

from agentserve.cli.child_process import die_with_parent, own_session

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")


def test_a_child_whose_parent_is_already_gone_never_runs() -> None:
    """As if the parent died between the fork and the prctl: no signal would ever come, so the child ends
    before its exec (a SIGKILLed fleet's worker kept serving, found in CI)."""
    other = functools.partial(die_with_parent, os.getpid() + 1_000_000)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], preexec_fn=other)
    assert child.wait(timeout=10) == 1


def test_a_child_of_a_live_parent_runs() -> None:
    child = subprocess.Popen([sys.executable, "-c", "print('ran')"], stdout=subprocess.PIPE, text=True,
                             **own_session())
    out, _ = child.communicate(timeout=30)
    assert child.returncode == 0 and out.strip() == "ran"
