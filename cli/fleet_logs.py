"""The temporary log folder of ``agentserve fleet up`` (without ``--log-dir``).

A fleet removes its folder as it stops, but a SIGKILLed one runs no clean-up.  So the folder is named after the
fleet's process, ``<tmp>/agentserve-<name>-pid<pid>-<start time>-<random>``, and every ``fleet up`` first removes
the folders of fleets whose process is gone.  The start time tells a recycled pid from the fleet's, as for
shared-memory segments (:func:`agentserve.shm.segment.pid_alive`).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

from agentserve.shm.segment import pid_alive, process_start_time

log = logging.getLogger("agentserve.fleet")

_NAME = re.compile(r"^agentserve-.+-pid(\d+)-(\d+)-[a-z0-9_]+$")  # mkdtemp's random part has no '-'


def make_log_dir(name: str) -> Path:
    """A new temporary folder for the members' output of fleet ``name``, named after this process."""
    pid = os.getpid()
    return Path(tempfile.mkdtemp(prefix=f"agentserve-{name}-pid{pid}-{process_start_time(pid)}-"))


def sweep_log_dirs() -> list[Path]:
    """Remove the temporary log folders (this user's) of fleets whose process is gone; the removed ones."""
    removed = []
    for entry in Path(tempfile.gettempdir()).glob("agentserve-*-pid*"):
        found = _NAME.match(entry.name)
        try:
            info = entry.lstat()  # a link is no folder of ours
        except FileNotFoundError:  # another fleet swept it first
            continue
        if found is None or not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            continue
        if not pid_alive(int(found[1]), int(found[2])):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    if removed:
        log.info("removed the log folders of %d fleets that were killed: %s", len(removed),
                 " ".join(map(str, removed)))
    return removed
