"""Project-wide test fixtures."""

from __future__ import annotations

import os
import signal

import pytest

from agentserve.shm.segment import pid_alive, read_header

SHM_DIR = "/dev/shm"

# A shell starts a command it puts in the background (`cmd &`, without job control) with SIGINT ignored, and the
# processes the tests start would inherit that: the tests that press Ctrl-C on them need it to arrive, as from a
# terminal.  Python's own handler here is reset to the default in every child.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True, scope="session")
def kernel_build_dir(tmp_path_factory):
    """The compiled CPU library is built into this session's temporary folder, not the user's cache (servers the
    tests start inherit the variable), with the built-in flags only (a developer's extra flags would change it)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AGENTSERVE_KERNEL_DIR", str(tmp_path_factory.mktemp("kernels")))
        mp.delenv("AGENTSERVE_KERNEL_CFLAGS", raising=False)
        yield


def _our_segments() -> set[str]:
    if not os.path.isdir(SHM_DIR):
        return set()
    return {n for n in os.listdir(SHM_DIR) if "agentserve" in n}


def _in_this_session(pid: int) -> bool:
    """``pid`` is this test process or one of its descendants (a server a test started)."""
    me = os.getpid()
    for _ in range(64):
        if pid == me:
            return True
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                pid = int(f.read().rsplit(b")", 1)[1].split()[1])  # the parent
        except (OSError, ValueError, IndexError):
            return False
        if pid <= 1:
            return False
    return False


def _someone_elses(entries: set[str]) -> set[str]:
    """Entries owned by a live process outside this test session (another pytest run on the machine); a
    semaphore goes with its segment.  A dead owner's entry is a leak whoever owned it."""
    segments = {e for e in entries if not e.startswith("sem.")}
    foreign = set()
    for entry in segments:
        header = read_header(entry)
        if header is not None and pid_alive(header[1], header[2]) and not _in_this_session(header[1]):
            foreign.add(entry)
    return foreign | {e for e in entries if e.startswith("sem.") and e[4:].rsplit(".", 1)[0] in foreign}


@pytest.fixture(autouse=True, scope="module")
def no_leftover_shared_memory():
    """Every test module must leave /dev/shm as it found it: no segment or semaphore of ours stays behind.

    Module scope, so a server shared by a module's tests is checked after it stops; tests/shm checks
    each test on its own as well.  Entries of live processes outside this session are not ours.
    """
    before = _our_segments()
    yield
    leaked = _our_segments() - before
    leaked -= _someone_elses(leaked)
    assert not leaked, f"test left shared-memory entries behind: {sorted(leaked)}"
