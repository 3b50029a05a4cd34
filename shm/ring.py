"""Single-producer / single-consumer message ring over POSIX shared memory.

Layout of the segment ``/agentserve-<run>-<role>`` (after the 64-byte segment header)::

    64   slots u32 · slot_size u32 · stride u32 · ring version u32
    80   writer pid i64 · writer start time i64 · reader pid i64 · reader start time i64
    128  writer_closed u8 · reader_closed u8
    192  reader_parked_on u32      (its own cache line: written by the reader only)
    256  writer_parked_on u32      (its own cache line: written by the writer only)
    320  slot 0 · slot 1 · …         (stride = 8 + slot_size rounded up to 64 bytes)

    slot:  +0 flag u8 · +4 length u32 · +8 payload[slot_size]

Two named semaphores go with it: ``.data`` (the writer posts, the reader sleeps on it) and
``.space`` (the reader posts, the writer sleeps on it).

State of one slot (the flag is the only shared word of a slot)::

              writer: length, payload, fence, flag := FULL
      EMPTY(0) ─────────────────────────────────────────────▶ FULL(1)
         ▲                                                      │
         └──────────────────────────────────────────────────────┘
              reader: fence, decode/copy payload, fence, flag := EMPTY

Head and tail are never shared.  The writer keeps its own index ``w`` and the reader its own
``r``; both start at slot 0 and step ``i → (i + 1) % slots``.  The writer only touches slot ``w``
when its flag is EMPTY, the reader only slot ``r`` when it is FULL, so every byte of a slot has
exactly one writer at any time: length and payload belong to the writer while EMPTY and to the
reader while FULL; the flag is handed over by the store that flips it.  A full ring is simply
"flag[w] is FULL": the writer waits, it never overwrites.

Why a reader never sees a half-written slot:

* The flag is a single byte, stored with one ``memoryview[i] = v`` — one byte cannot tear.
  (``struct.pack_into`` writes byte by byte, which is why no shared index is ever packed: the
  length word is packed, but only while its slot is private to the writer.)
* Order: payload and length are stored *before* the flag; the reader loads the flag *before* the
  payload; the reader is done with the payload *before* it stores EMPTY.  CPython does each of
  these as a separate C call (``memcpy`` inside the interpreter), so the compiler cannot move one
  across another.  On x86-64 (TSO) the hardware keeps store→store, load→load and load→store
  order, so nothing more is needed there (``segment.TSO``: these three points cost nothing).
  Weakly ordered CPUs (AArch64, POWER) may make stores visible out of order, so there both sides
  call :func:`~agentserve.shm.segment.fence` at the three hand-over points.
* The fence is a lock acquire + release, an atomic read-modify-write: a full barrier on x86-64
  (``lock cmpxchg``), ~0.1 µs.  On AArch64 it is acquire/release ordering through glibc's
  semaphore atomics, which is what vLLM relies on too but is weaker than a ``dmb ish`` in the
  architecture's model; a two-line C extension issuing a real barrier would close that gap.
  Only x86-64 is tested here.
* The slot length is a 4-byte aligned store through a ``uint32`` memoryview (one instruction);
  it needs no atomicity anyway, since only the slot's current owner touches it.

Waiting (vLLM ``shm_broadcast`` history: lost wake-ups, 100 % CPU spinning):

1. look at the flag 64 times (~2 µs), then spin for ``spin_s`` more (default 0).  Spinning only
   pays with a core per process: on a shared CPU a spinner that gets preempted is not woken by
   the peer's post and comes back milliseconds later (measured: p99 50 ms with a 2 ms spin on
   a loaded 2-core box, against ~0.2 ms parked), and a woken sleeper is scheduled sooner than a
   spinner.  A spin that sees the clock jump (> 50 µs between two looks: it was preempted) parks
   at once.  Results that arrive every ~10 ms of GPU time are waited for parked anyway.  No
   ``sched_yield`` in the spin, for the same reason;
2. park: store "parked on slot k" (k + 1, a u32 of my own cache line), fence, re-check the
   flag, then ``sem.acquire(slice)`` (it releases the GIL; slice ≤ 100 ms), re-checking the flag
   after every wake-up, timeout or not.  The peer, after flipping slot i, fences and posts the
   semaphore only if the parked-on word says i + 1.  Both sides store-fence-load (Dekker), so at
   least one sees the other: no lost wake-up (and a lost one would cost one slice, not a hang).
   A reader parks on its next slot; a writer facing a full ring parks on the slot a quarter of
   the ring ahead, so it wakes once per ``slots / 4`` freed slots instead of once per slot (it
   still takes the first free slot at its next slice, so a reader that stops early costs ≤ 100 ms,
   never a deadlock).  Stray posts only cause one extra re-check.
3. From the first slice on, the waiter checks between slices that the peer pid is alive
   (zombies count as dead, a recycled pid is caught by its start time) and always that nobody
   closed the ring: ``PeerDied`` within ~0.2 s, ``RingClosed`` at once, never a hang.  A reader
   drains what is left before raising.

An idle parked reader wakes 10 times a second to check its peer: ~0 % of a core.

Threads: each end serialises its calls with a lock, so one end may be shared by threads of its
process; :meth:`close` may come from any thread — a call waiting in another thread is woken with
``RingClosed`` and the unmapping happens as it leaves.  :meth:`shutdown` is signal-handler safe.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
import time
from typing import Any

import msgspec
import numpy as np
import posix_ipc

from agentserve.protocol.ring_messages import Codec

from . import segment as sg
from .errors import CorruptFrame, MessageTooLarge, PeerDied, RingClosed, RingTimeout

RING_VERSION = 1
EMPTY = 0
FULL = 1
DEFAULT_SPIN_S = 0.0  # after 64 quick looks (~2 us); raise it only with a core per process
PARK_SLICE_S = 0.1

_GEOM = struct.Struct("<IIII")  # slots, slot_size, stride, ring version
_GEOM_OFF = 64
_PIDS_OFF = 80  # 4 x i64: writer pid, writer start, reader pid, reader start
_WRITER_CLOSED = 128
_READER_CLOSED = 129
_READER_WAITING = 192 // 4  # u32 index: slot the parked reader waits on, + 1 (0: not parked)
_WRITER_WAITING = 256 // 4  # u32 index: slot the parked writer waits on, + 1
_SLOTS_OFF = 320
_SLOT_HDR = 8
_LOST_CPU_S = 50e-6  # 32 flag checks take ~1 us: this long means we lost the CPU meanwhile
_acquire, _release = sg.fence_lock.acquire, sg.fence_lock.release
_ORDER = not sg.TSO  # whether the hand-over points need a fence on this CPU

Payload = bytes | bytearray | memoryview


def ring_bytes(slots: int, slot_size: int) -> int:
    """Size of a ring segment's body (after the segment header)."""
    return _SLOTS_OFF - sg.HEADER_SIZE + slots * _stride(slot_size)


def _stride(slot_size: int) -> int:
    return (_SLOT_HDR + slot_size + 63) // 64 * 64


class _RingEnd:
    """What both ends share: the mapping, the semaphores, peer and close bookkeeping."""

    _side = ""  # "writer" or "reader"
    _peer_side = ""

    def __init__(self, seg: sg.Segment, data: Any, space: Any, codec: Codec | None, spin_s: float) -> None:
        self._seg = seg
        self._buf = seg.buf
        self._pids = np.frombuffer(seg.buf, dtype=np.int64, count=4, offset=_PIDS_OFF)
        self._lens = seg.buf.cast("I")  # 4-byte aligned stores / loads of slot lengths
        self.slots, self.slot_size, self._stride, version = _GEOM.unpack_from(seg.buf, _GEOM_OFF)
        if version != RING_VERSION:
            raise sg.SegmentError(f"{seg.name}: ring version {version}, expected {RING_VERSION}")
        self._offsets = [_SLOTS_OFF + i * self._stride for i in range(self.slots)]
        self._data_sem = data
        self._space_sem = space
        self.codec = codec
        self.spin_s = spin_s
        self._index = 0
        self._expected_peer = 0
        self._shut = False
        self._close_pending = False
        self._released = False
        self._op = threading.Lock()  # one call at a time; close() waits for it to leave
        me = 0 if self._side == "writer" else 2
        self._pid = os.getpid()
        self._pids[me + 1] = sg.process_start_time(self._pid)
        self._pids[me] = self._pid
        self._peer_pid = 0

    # -- identity --------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._seg.name

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def peer_pid(self) -> int:
        """The peer's pid once it attached, else the one given to :meth:`expect_peer`, else 0."""
        if not self._released:
            self._peer_pid = int(self._pids[2 if self._side == "writer" else 0])
        return self._peer_pid or self._expected_peer

    def expect_peer(self, pid: int) -> None:
        """Watch ``pid`` (e.g. a just-spawned child) for death until the peer attaches itself."""
        self._expected_peer = pid

    def peer_alive(self) -> bool:
        if self._released:
            return False
        slot = 2 if self._side == "writer" else 0
        pid, start = int(self._pids[slot]), int(self._pids[slot + 1])
        if pid:
            return sg.pid_alive(pid, start)
        return not self._expected_peer or sg.pid_alive(self._expected_peer)

    # -- waiting ---------------------------------------------------------------------------

    def _wait_while(
        self, off: int, busy: int, timeout: float | None, sem: Any, waiting: int, park: int
    ) -> None:
        """Return once ``flag[off] != busy``: spin on it, then park until slot ``park`` changes.

        ``waiting`` is this side's u32 "parked on slot" word (see module docstring).
        """
        buf = self._buf
        deadline = None if timeout is None else time.monotonic() + timeout
        spin_s = self.spin_s if timeout is None else min(self.spin_s, timeout)
        for _ in range(64):
            if buf[off] != busy:
                return
        clock = time.perf_counter
        now = clock()
        spin_end = now + spin_s
        while now < spin_end:  # busy spin (no sched_yield: a yielder comes back late on a busy CPU)
            for _ in range(32):
                if buf[off] != busy:
                    return
            before, now = now, clock()
            if now - before > _LOST_CPU_S:  # we were preempted: the CPU is contended, so park
                break  # (the scheduler favours a woken sleeper over a spinner)
        park_off = self._offsets[park]
        self._lens[waiting] = park + 1
        next_check = time.monotonic() + PARK_SLICE_S
        try:
            while True:
                sg.fence()
                if buf[park_off] != busy or buf[off] != busy:  # the latter: at least every slice
                    return
                self._check_open()
                now = time.monotonic()
                if now >= next_check:  # not on the first park: reading /proc costs ~20 us
                    if not self.peer_alive():
                        raise PeerDied(self._peer_side, self.peer_pid)
                    next_check = now + PARK_SLICE_S
                wait = PARK_SLICE_S
                if deadline is not None:
                    left = deadline - now
                    if left <= 0:
                        raise RingTimeout(self._timeout_message(timeout))
                    wait = min(wait, left)
                with contextlib.suppress(posix_ipc.BusyError):
                    sem.acquire(wait)
        finally:
            self._lens[waiting] = 0

    def _hand_over(self, off: int, i: int, flag: int, peer_waiting: int, peer_sem: Any) -> None:
        """Give slot ``i`` to the peer (``flag``), advance, and wake the peer if it parked on this slot."""
        self._buf[off] = flag
        self._index = i + 1 if i + 1 < self.slots else 0
        _acquire()  # full fence: flag before reading the peer's waiting word (Dekker with a parking peer)
        _release()
        if self._lens[peer_waiting] == i + 1:
            peer_sem.release()

    def _check_open(self) -> None:
        if self._shut or self._buf[_WRITER_CLOSED] or self._buf[_READER_CLOSED]:
            raise RingClosed(f"ring {self.name} is closed")

    def _timeout_message(self, timeout: float | None) -> str:
        raise NotImplementedError

    # -- shutdown --------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Mark this end closed and wake both sides; safe from any thread or a signal handler.

        A waiting peer (and a waiting call of this end) returns promptly with ``RingClosed``.
        """
        self._shut = True
        with contextlib.suppress(TypeError, ValueError):  # TypeError/ValueError: already unmapped
            self._buf[_WRITER_CLOSED if self._side == "writer" else _READER_CLOSED] = 1
            sg.fence()
        for sem in (self._data_sem, self._space_sem):
            with contextlib.suppress(posix_ipc.ExistentialError):
                sem.release()

    def close(self) -> None:
        """Shut down, unlink every name (creator only), then unmap and close the semaphores.

        Safe from any thread: a call of this end in flight in another thread is woken with
        ``RingClosed`` and the unmapping happens when it has left.
        """
        self.shutdown()
        if self._seg.owner:
            self._seg.unlink()
            for sem in (self._data_sem, self._space_sem):
                sg.unlink_semaphore(sem.name)
        self._close_pending = True
        self._finish_close()

    def _finish_close(self) -> None:
        if self._released or not self._op.acquire(False):
            return  # done already, or a call is in flight: it finishes the close on its way out
        try:
            if self._released:
                return
            self._released = True
            for sem in (self._data_sem, self._space_sem):
                with contextlib.suppress(posix_ipc.ExistentialError):
                    sem.close()
            self._pids = None
            self._lens.release()
            self._buf = None
            self._seg.close()
        finally:
            self._op.release()

    @property
    def closed(self) -> bool:
        """True once either end closed the ring."""
        if self._shut:
            return True
        try:
            return bool(self._buf[_WRITER_CLOSED] or self._buf[_READER_CLOSED])
        except (TypeError, ValueError):  # unmapped meanwhile
            return True

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        run: str,
        role: str,
        slots: int = 64,
        slot_size: int = 64 * 1024,
        codec: Codec | None = None,
        spin_s: float = DEFAULT_SPIN_S,
    ):
        """Create the ring ``/agentserve-<run>-<role>`` and return this end of it."""
        if slots < 1 or not 1 <= slot_size < 2**32 - _SLOT_HDR:
            raise ValueError(f"need slots >= 1 and 1 <= slot_size < 2**32, got {slots} x {slot_size}")
        name = sg.shm_name(run, role)
        seg = sg.Segment.create(name, ring_bytes(slots, slot_size), sg.KIND_RING)
        sems: list[Any] = []
        try:
            _GEOM.pack_into(seg.buf, _GEOM_OFF, slots, slot_size, _stride(slot_size), RING_VERSION)
            sems.append(sg.create_semaphore(sg.sem_name(run, role, "data")))
            sems.append(sg.create_semaphore(sg.sem_name(run, role, "space")))
            end = cls(seg, sems[0], sems[1], codec, spin_s)
            seg.mark_ready()
            return end
        except BaseException:
            for sem in sems:
                sg.remove_semaphore(sem, owner=True)
            seg.close()
            raise

    @classmethod
    def attach(
        cls,
        run: str,
        role: str,
        codec: Codec | None = None,
        timeout: float = 10.0,
        spin_s: float = DEFAULT_SPIN_S,
    ):
        """Attach to an existing ring (waiting up to ``timeout`` for it to be ready)."""
        seg = sg.Segment.attach(sg.shm_name(run, role), sg.KIND_RING, timeout)
        sems: list[Any] = []
        try:
            sems.append(sg.open_semaphore(sg.sem_name(run, role, "data")))
            sems.append(sg.open_semaphore(sg.sem_name(run, role, "space")))
            return cls(seg, sems[0], sems[1], codec, spin_s)
        except BaseException:
            for sem in sems:
                sg.remove_semaphore(sem, owner=False)
            seg.close()
            raise


class RingWriter(_RingEnd):
    """The producing end: :meth:`put` copies one message into the next slot."""

    _side = "writer"
    _peer_side = "reader"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._scratch = bytearray(self.slot_size)
        self._refill = self.slots // 4

    def put(self, msg: Payload | msgspec.Struct, timeout: float | None = None) -> None:
        """Publish ``msg`` (raw bytes, or a Struct encoded with this end's codec).

        Waits while the ring is full; raises ``RingTimeout`` after ``timeout`` seconds (``None``:
        forever, ``0``: do not wait), ``MessageTooLarge`` if it exceeds a slot, ``PeerDied`` /
        ``RingClosed`` if the reader went away.
        """
        op = self._op
        op.acquire()
        try:
            self._put(msg, timeout)
        finally:
            op.release()
            if self._close_pending:
                self._finish_close()

    def _put(self, msg: Payload | msgspec.Struct, timeout: float | None) -> None:
        if self._shut:
            raise RingClosed(f"ring {self.name} is closed")
        kind = type(msg)
        if kind is bytes or kind is bytearray:
            data = msg
        elif kind is memoryview:
            data = msg if msg.format == "B" and msg.ndim == 1 else msg.cast("B")
        elif self.codec is None:
            raise TypeError("this ring end has no codec: pass bytes or give a codec")
        else:
            self.codec.encode_into(msg, self._scratch)
            data = self._scratch
        n = len(data)
        if n > self.slot_size:
            raise MessageTooLarge(n, self.slot_size)
        buf = self._buf
        if buf[_READER_CLOSED]:
            raise RingClosed(f"ring {self.name} is closed")
        i = self._index
        off = self._offsets[i]
        if buf[off] != EMPTY:
            # the ring is full; wake up only when a quarter of it is free again (fewer wake-ups)
            park = (i + self._refill) % self.slots
            self._wait_while(off, FULL, timeout, self._space_sem, _WRITER_WAITING, park)
            if buf[off] != EMPTY:
                raise CorruptFrame(f"slot {i} of {self.name} has flag {buf[off]} (expected 0 or 1)")
        self._lens[(off >> 2) + 1] = n
        buf[off + _SLOT_HDR : off + _SLOT_HDR + n] = data
        if _ORDER:
            sg.fence()  # payload before flag (weakly ordered CPUs only)
        self._hand_over(off, i, FULL, _READER_WAITING, self._data_sem)

    def _timeout_message(self, timeout: float | None) -> str:
        return f"ring {self.name} stayed full ({self.slots} slots) for {timeout} s: reader not keeping up"


class RingReader(_RingEnd):
    """The consuming end: :meth:`get` decodes the next message, :meth:`get_bytes` copies it."""

    _side = "reader"
    _peer_side = "writer"

    def get(self, timeout: float | None = None) -> msgspec.Struct:
        """The next message, decoded straight from the slot with this end's codec.

        Raises ``RingTimeout`` after ``timeout`` seconds of empty ring (``None``: wait forever),
        ``PeerDied`` / ``RingClosed`` once the ring is drained and the writer is gone,
        ``DecodeError`` (``CorruptFrame`` for a bad frame) for an undecodable slot, which is
        consumed so the next call goes on with the next slot.
        """
        if self.codec is None:
            raise TypeError("this ring end has no codec: use get_bytes() or give a codec")
        return self._take(timeout, self.codec.decode)

    def get_bytes(self, timeout: float | None = None) -> bytes:
        """The next message's raw bytes (a copy)."""
        return self._take(timeout, bytes)

    def poll(self) -> bool:
        """Whether a message is ready (never blocks; ``False`` once closed)."""
        try:
            return self._buf[self._offsets[self._index]] != EMPTY
        except (TypeError, ValueError):  # closed: unmapped
            return False

    def _take(self, timeout: float | None, convert: Any) -> Any:
        op = self._op
        op.acquire()
        try:
            return self._take_locked(timeout, convert)
        finally:
            op.release()
            if self._close_pending:
                self._finish_close()

    def _take_locked(self, timeout: float | None, convert: Any) -> Any:
        if self._shut:
            raise RingClosed(f"ring {self.name} is closed")
        buf = self._buf
        i = self._index
        off = self._offsets[i]
        flag = buf[off]
        if flag != FULL:
            if flag == EMPTY:
                self._wait_while(off, EMPTY, timeout, self._data_sem, _READER_WAITING, i)
                flag = buf[off]
            if flag != FULL:
                raise CorruptFrame(f"slot {i} of {self.name} has flag {flag} (expected 0 or 1)")
        if _ORDER:
            sg.fence()  # flag before payload (weakly ordered CPUs only)
        try:
            n = self._lens[(off >> 2) + 1]
            if n > self.slot_size:
                raise CorruptFrame(f"slot {i} of {self.name} claims {n} bytes > slot {self.slot_size}")
            view = buf[off + _SLOT_HDR : off + _SLOT_HDR + n]
            try:
                return convert(view)
            finally:
                view.release()  # even if an exception's traceback still references it
        finally:
            if _ORDER:
                sg.fence()  # done with the payload before handing the slot back
            self._hand_over(off, i, EMPTY, _WRITER_WAITING, self._space_sem)

    def _timeout_message(self, timeout: float | None) -> str:
        return f"no message on ring {self.name} within {timeout} s"
