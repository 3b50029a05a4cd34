"""The HTTP gateway's watcher restarts it when it exits on its own, after a pause that doubles while it keeps failing
and starts over once it had run a while (it never did: a gateway that crashed once a day waited ever longer)."""

from __future__ import annotations

import logging
import sys
import time

from agentserve.cli import gateway_process
from agentserve.cli.gateway_process import GatewayProcess

# Each run counts itself in a file: runs 1-3 and 5-6 exit at once, run 4 runs 0.4 s (longer than HEALTHY_S here).
SCRIPT = """
import pathlib, sys, time
f = pathlib.Path(sys.argv[1]); n = int(f.read_text() or 0) + 1 if f.exists() else 1; f.write_text(str(n))
time.sleep(0.4 if n == 4 else 0)
"""


def test_the_restart_pause_doubles_and_starts_over_after_a_healthy_run(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setattr(gateway_process, "FIRST_PAUSE_S", 0.01)
    monkeypatch.setattr(gateway_process, "HEALTHY_S", 0.2)
    counter = tmp_path / "runs"
    gateway = GatewayProcess("ipc:///unused", "127.0.0.1", 1, [])
    gateway.command = [sys.executable, "-c", SCRIPT, str(counter)]
    with caplog.at_level(logging.ERROR, logger="agentserve.up.gateway"):
        gateway.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (not counter.exists() or int(counter.read_text() or 0) < 7):
            time.sleep(0.02)
        gateway.stop()
    pauses = [r.args[1] for r in caplog.records if "restarting it in" in r.msg]
    assert [round(p * 100) for p in pauses[:6]] == [1, 2, 4, 1, 2, 4]  # run 4 was healthy: the 4th starts over
