"""A command that a Ctrl-C interrupts ends with one line and exit status 130 (128 + SIGINT, as `up` forced by a
signal exits 128 + its number), not with click's 'Aborted!' and exit status 1."""

from __future__ import annotations

import subprocess
import sys

import pytest

# the command's work replaced by a real SIGINT to itself: the interruption arrives as it would from the terminal
INTERRUPTED_AT_WORK = ("import os, signal, sys, time\n"
                       "import {module} as command\n"
                       "def at_work(*args, **kwargs):\n"
                       "    os.kill(os.getpid(), signal.SIGINT)\n"
                       "    time.sleep(60)\n"
                       "command.{function} = at_work\n"
                       "from agentserve.cli.main import main\n"
                       "main(sys.argv[1:], prog_name='agentserve')\n")


@pytest.mark.parametrize("module, function, args", [
    ("agentserve.cli.generate", "run_generate", ["generate", "--prompt", "hi"]),
    ("agentserve.cli.bench", "run_sweep", ["bench", "--target", "http://127.0.0.1:9", "--duration", "1"]),
])
def test_ctrl_c_ends_a_command_with_one_line_and_exit_status_130(module, function, args):
    script = INTERRUPTED_AT_WORK.format(module=module, function=function)
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 130, done.stderr
    assert done.stderr.strip() == f"agentserve {args[0]}: interrupted", done.stderr
