"""POSIX shared-memory segments and named semaphores: naming, lifecycle and cleanup.

Names: a segment is ``/agentserve-<run>-<role>``, a semaphore ``/agentserve-<run>-<role>.<what>``
(on Linux they show up in ``/dev/shm`` as ``agentserve-…`` and ``sem.agentserve-…``).  ``run`` may
contain ``-``; ``role`` and ``what`` may not, so a name parses back from its last ``-``.

Lifecycle of a segment::

    owner:    shm_open(O_CREAT|O_EXCL) + ftruncate(size)     (posix_ipc does both in one call)
              write header (magic, kind, owner pid + start time, size), fence, ready byte := 1
    attacher: shm_open → wait until st_size >= header (never maps size 0)
              → map → wait until ready byte == 1 → check magic / kind
    owner:    close() unmaps and unlinks; so do the atexit hook and the SIGTERM hook
              (:func:`register_cleanup`), and the ``except`` path of a failed create

The owner's pid and process start time live in the header, so :func:`cleanup_stale` can remove
what a dead run left behind without touching a live one (a recycled pid has another start time).
``posix_ipc`` never registers anything with ``multiprocessing.resource_tracker`` and this module
uses nothing that does, so the tracker neither unlinks our segments nor prints warnings.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import mmap
import os
import platform
import re
import signal
import struct
import threading
import time
from collections.abc import Callable

import posix_ipc

from .errors import SegmentError, SegmentNotFound

log = logging.getLogger(__name__)

PREFIX = "agentserve"
SHM_DIR = "/dev/shm"
MAGIC = b"AGSRVSHM"
HEADER_VERSION = 1
HEADER_SIZE = 64
KIND_RING = 1
KIND_BOARD = 2

# magic, header version, kind, owner pid, owner start time, total size
_HEADER = struct.Struct("<8sIIqqQ")
_READY_OFF = 40  # one byte, stored last by the owner
_RUN_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]{0,63}$")
_ROLE_RE = re.compile(r"^[A-Za-z0-9_]{1,48}$")
_STALE_UNREADY_S = 30.0  # a segment never marked ready for this long was left by a crashed create

#: Acquiring it is an atomic read-modify-write: ``fence_lock.acquire(); fence_lock.release()`` is
#: a full barrier on x86-64 (``lock cmpxchg``); see ``ring.py`` for other CPUs.
fence_lock = threading.Lock()


def fence() -> None:
    """A memory barrier (store→load included on x86-64); see :data:`fence_lock`."""
    fence_lock.acquire()
    fence_lock.release()


def _no_fence() -> None:
    pass


#: Total store order (x86): stores stay ordered with stores, loads with loads, and a store never
#: passes an earlier load; only a store followed by a load may be reordered.
TSO = platform.machine().lower() in ("x86_64", "amd64", "i386", "i486", "i586", "i686")

#: Orders store→store, load→load and load→store.  Free on TSO machines, :func:`fence` elsewhere.
#: A store followed by a load of *another* word (Dekker) always needs :func:`fence`.
order_fence = _no_fence if TSO else fence


def check_run(run: str) -> str:
    """``run`` if it is a valid run name (it names segments, semaphores and sockets), else ``ValueError``."""
    if not _RUN_RE.match(run):
        raise ValueError(f"run name must match {_RUN_RE.pattern}, got {run!r}")
    return run


def shm_name(run: str, role: str) -> str:
    """``/agentserve-<run>-<role>`` after validating both parts."""
    check_run(run)
    if not _ROLE_RE.match(role):
        raise ValueError(f"role must match {_ROLE_RE.pattern}, got {role!r}")
    return f"/{PREFIX}-{run}-{role}"


def sem_name(run: str, role: str, what: str) -> str:
    if not _ROLE_RE.match(what):
        raise ValueError(f"semaphore suffix must match {_ROLE_RE.pattern}, got {what!r}")
    return f"{shm_name(run, role)}.{what}"


def process_start_time(pid: int) -> int:
    """The start time of ``pid`` in clock ticks since boot (Linux), 0 where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return 0
    return int(stat.rsplit(b")", 1)[1].split()[19])


def pid_alive(pid: int, start_time: int = 0) -> bool:
    """Whether ``pid`` runs (zombies count as dead) and, if given, started at ``start_time``."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return not os.path.isdir("/proc/self")  # no procfs: trust kill(0); with procfs: gone
    if fields[0] in (b"Z", b"X"):
        return False
    return not start_time or int(fields[19]) == start_time


# ---------------------------------------------------------------- cleanup on exit / SIGTERM

_cleanups: dict[str, tuple[int, Callable[[], None]]] = {}
# reentrant: a signal handler (`up`'s forced stop, the SIGTERM hook) runs the clean-ups in the thread that may hold it
_cleanup_lock = threading.RLock()
_hooks_installed = False


def register_cleanup(name: str, unlink: Callable[[], None]) -> None:
    """Run ``unlink`` at interpreter exit and on SIGTERM (only in the registering process).

    Unlinking removes the name only: mappings and open semaphores keep working, so this is safe
    to run while the process is still using them.
    """
    with _cleanup_lock:
        _cleanups[name] = (os.getpid(), unlink)
    _install_hooks()


def unregister_cleanup(name: str) -> None:
    with _cleanup_lock:
        _cleanups.pop(name, None)


def run_cleanups() -> None:
    """Unlink every name this process registered (idempotent)."""
    with _cleanup_lock:
        items = list(_cleanups.items())
        _cleanups.clear()
    me = os.getpid()
    for name, (pid, unlink) in items:
        if pid != me:  # inherited through fork: not ours to remove
            continue
        try:
            unlink()
        except Exception:  # noqa: BLE001 — cleanup must go on for the other names
            log.exception("failed to unlink %s", name)


def _install_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(run_cleanups)
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread; atexit still covers exit
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_IGN:
        return

    def on_sigterm(signum: int, frame: object) -> None:
        run_cleanups()
        if callable(previous):
            previous(signum, frame)
        else:  # default action: die by SIGTERM, as without us
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)


# ---------------------------------------------------------------- segments


def _unlink_shm(name: str) -> None:
    with contextlib.suppress(posix_ipc.ExistentialError):
        posix_ipc.unlink_shared_memory(name)


def _unlink_sem(name: str) -> None:
    with contextlib.suppress(posix_ipc.ExistentialError):
        posix_ipc.unlink_semaphore(name)


class Segment:
    """One mapped shared-memory segment with the common 64-byte header.

    ``buf`` is a writable (or, for read-only attachers, read-only) memoryview of the whole
    segment; users must drop every view they derived from it before :meth:`close`.
    """

    def __init__(self, name: str, mm: mmap.mmap, owner: bool) -> None:
        self.name = name
        self.owner = owner
        self.size = len(mm)
        self._mm = mm
        self.buf = memoryview(mm)
        self.closed = False

    @classmethod
    def create(cls, name: str, size: int, kind: int) -> Segment:
        """Create ``name`` exclusively with its final size, write the header, mark it ready."""
        total = HEADER_SIZE + size
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=total)
        except posix_ipc.ExistentialError:
            raise SegmentError(f"shared-memory segment {name} already exists") from None
        try:
            mm = mmap.mmap(shm.fd, total)
            shm.close_fd()
            pid = os.getpid()
            _HEADER.pack_into(mm, 0, MAGIC, HEADER_VERSION, kind, pid, process_start_time(pid), total)
            seg = cls(name, mm, owner=True)
        except BaseException:
            shm.close_fd()
            _unlink_shm(name)
            raise
        register_cleanup(name, lambda: _unlink_shm(name))
        return seg

    def mark_ready(self) -> None:
        """Publish the segment to attachers: everything written before is visible to them."""
        fence()
        self.buf[_READY_OFF] = 1

    @classmethod
    def attach(cls, name: str, kind: int, timeout: float = 5.0, read_only: bool = False) -> Segment:
        """Map an existing segment once it exists, has its size and is marked ready."""
        deadline = time.monotonic() + timeout
        while True:
            mm = _try_map(name, read_only)
            if mm is not None:
                if mm[_READY_OFF]:
                    fence()
                    break
                mm.close()
            if time.monotonic() >= deadline:
                raise SegmentNotFound(f"no ready shared-memory segment {name} after {timeout:.1f} s")
            time.sleep(0.002)
        magic, version, found_kind, _pid, _start, total = _HEADER.unpack_from(mm, 0)
        if magic != MAGIC or version != HEADER_VERSION or found_kind != kind or total != len(mm):
            mm.close()
            raise SegmentError(
                f"{name} is not an agentserve segment of kind {kind} "
                f"(magic={magic!r}, header version={version}, kind={found_kind}, size={total})"
            )
        return cls(name, mm, owner=False)

    @property
    def owner_pid(self) -> int:
        return _HEADER.unpack_from(self.buf, 0)[3]

    def owner_alive(self) -> bool:
        _m, _v, _k, pid, start, _t = _HEADER.unpack_from(self.buf, 0)
        return pid_alive(pid, start)

    def unlink(self) -> None:
        if self.owner:
            _unlink_shm(self.name)
            unregister_cleanup(self.name)

    def close(self) -> None:
        """Unmap, and unlink if this process created the segment (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self.unlink()
        try:
            self.buf.release()
            self._mm.close()
        except BufferError:  # a caller still holds a view: the mapping goes when that view does
            log.warning("%s: a view into the segment is still alive; unmapping deferred", self.name)

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _try_map(name: str, read_only: bool) -> mmap.mmap | None:
    """Map ``name`` if it exists and already has at least its header; else ``None``."""
    try:
        shm = posix_ipc.SharedMemory(name, read_only=read_only)
    except posix_ipc.ExistentialError:
        return None
    try:
        size = os.fstat(shm.fd).st_size
        if size < HEADER_SIZE:
            return None  # created but not yet sized: never map size 0
        access = mmap.ACCESS_READ if read_only else mmap.ACCESS_WRITE
        return mmap.mmap(shm.fd, size, access=access)
    finally:
        shm.close_fd()


# ---------------------------------------------------------------- semaphores


def create_semaphore(name: str) -> posix_ipc.Semaphore:
    """Create a named semaphore (value 0) that atexit / SIGTERM will unlink."""
    try:
        sem = posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=0)
    except posix_ipc.ExistentialError:
        raise SegmentError(f"semaphore {name} already exists") from None
    register_cleanup(name, lambda: _unlink_sem(name))
    return sem


def open_semaphore(name: str) -> posix_ipc.Semaphore:
    try:
        return posix_ipc.Semaphore(name)
    except posix_ipc.ExistentialError:
        raise SegmentNotFound(f"no semaphore {name}") from None


def unlink_semaphore(name: str) -> None:
    """Remove a semaphore's name (open handles keep working) and forget its cleanup."""
    _unlink_sem(name)
    unregister_cleanup(name)


def remove_semaphore(sem: posix_ipc.Semaphore, owner: bool) -> None:
    """Close ``sem`` and, for its creator, unlink the name."""
    name = sem.name
    with contextlib.suppress(posix_ipc.ExistentialError):
        sem.close()
    if owner:
        _unlink_sem(name)
        unregister_cleanup(name)


# ---------------------------------------------------------------- discovery and stale cleanup


def read_header(entry: str) -> tuple[int, int, int, bool] | None:
    """``(kind, owner pid, owner start time, ready)`` of ``/dev/shm/<entry>``, or ``None``."""
    try:
        with open(os.path.join(SHM_DIR, entry), "rb") as f:
            raw = f.read(HEADER_SIZE)
    except OSError:
        return None
    if len(raw) < HEADER_SIZE:
        return None
    magic, version, kind, pid, start, _total = _HEADER.unpack_from(raw, 0)
    if magic != MAGIC or version != HEADER_VERSION:
        return None
    return kind, pid, start, bool(raw[_READY_OFF])


def list_segments(prefix: str = PREFIX + "-") -> list[str]:
    """``/dev/shm`` entries (segments, not semaphores) whose name starts with ``prefix``."""
    prefix = prefix.lstrip("/")
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith(prefix))


def _segment_is_stale(entry: str) -> bool:
    header = read_header(entry)
    if header is not None and header[3]:
        return not pid_alive(header[1], header[2])
    try:  # not (yet) ready: stale only once it has been so for a long time
        age = time.time() - os.stat(os.path.join(SHM_DIR, entry)).st_mtime
    except OSError:
        return False
    return age > _STALE_UNREADY_S


def cleanup_stale(prefix: str = PREFIX + "-") -> list[str]:
    """Remove segments under ``prefix`` whose owner died, and semaphores without a live segment.

    Returns the removed names.  Segments of live owners are never touched.
    """
    prefix = prefix.lstrip("/")
    removed = []
    for entry in list_segments(prefix):
        if _segment_is_stale(entry):
            _unlink_shm("/" + entry)
            removed.append("/" + entry)
    alive = set(list_segments(prefix))
    for entry in list_segments("sem." + prefix):
        segment = entry[len("sem.") :].rsplit(".", 1)[0]
        if segment not in alive:
            _unlink_sem("/" + entry[len("sem.") :])
            removed.append("/" + entry[len("sem.") :])
    if removed:
        log.info("removed %d stale shared-memory entries: %s", len(removed), removed)
    return removed
