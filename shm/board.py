"""The stats board: one writer overwrites a snapshot, any number of readers copy it (seqlock).

Layout of ``/agentserve-<run>-board`` (after the 64-byte segment header)::

    64   layout version u32 · capacity u32
    128  seq u64                (its own cache line; one aligned 8-byte store per update)
    136  length u32
    192  payload[capacity]      (msgspec bytes of the snapshot; its schema belongs to the writer)

Writer (never waits)::                     Reader (retries, never writes)::

    seq := seq + 1   (odd: writing)          s1 := seq;  odd → retry
    fence                                    fence
    length, payload                          copy length, payload
    fence                                    fence
    seq := seq + 1   (even: stable)          s2 := seq;  s1 != s2 → retry

``seq`` goes through a numpy ``uint64`` view, so each update is one aligned 8-byte store and each
read one 8-byte load (never torn; ``struct.pack_into`` would write it byte by byte).  A reader
mapping is read-only: a reader cannot disturb the writer or other readers.  ``seq == 0`` means
nothing was published yet.  The layout version names the snapshot schema; a reader built for
another version gets :class:`BoardVersionMismatch` naming both.
"""

from __future__ import annotations

import struct
import time

import numpy as np

from . import segment as sg
from .errors import BoardBusy, BoardVersionMismatch, MessageTooLarge

_INFO = struct.Struct("<II")  # layout version, capacity
_LEN = struct.Struct("<I")
_INFO_OFF = 64
_SEQ_OFF = 128
_LEN_OFF = 136
_PAYLOAD_OFF = 192
ROLE = "board"


class StatsBoard:
    """One end of a stats board: the creator publishes, attachers read."""

    def __init__(self, seg: sg.Segment) -> None:
        self._seg = seg
        self._buf = seg.buf
        self._seq = np.frombuffer(seg.buf, dtype=np.uint64, count=1, offset=_SEQ_OFF)
        self.version, self.capacity = _INFO.unpack_from(seg.buf, _INFO_OFF)
        self._next = int(self._seq[0])

    @classmethod
    def create(cls, run: str, size: int, version: int) -> StatsBoard:
        """Create the board of ``run`` for snapshots of up to ``size`` bytes in layout ``version``."""
        seg = sg.Segment.create(sg.shm_name(run, ROLE), _PAYLOAD_OFF - sg.HEADER_SIZE + size, sg.KIND_BOARD)
        try:
            _INFO.pack_into(seg.buf, _INFO_OFF, version, size)
            board = cls(seg)
            seg.mark_ready()
            return board
        except BaseException:
            seg.close()
            raise

    @classmethod
    def attach(cls, run: str, version: int, timeout: float = 2.0) -> StatsBoard:
        """Attach read-only to ``run``'s board; ``BoardVersionMismatch`` if its layout differs."""
        seg = sg.Segment.attach(sg.shm_name(run, ROLE), sg.KIND_BOARD, timeout, read_only=True)
        found = _INFO.unpack_from(seg.buf, _INFO_OFF)[0]
        if found != version:
            seg.close()
            raise BoardVersionMismatch(found, version)
        return cls(seg)

    def publish(self, data: bytes | bytearray | memoryview) -> None:
        """Replace the snapshot (writer only; never blocks)."""
        n = len(data)
        if n > self.capacity:
            raise MessageTooLarge(n, self.capacity)
        seq = self._seq
        self._next += 1
        seq[0] = self._next  # odd: readers keep away
        sg.order_fence()
        _LEN.pack_into(self._buf, _LEN_OFF, n)
        self._buf[_PAYLOAD_OFF : _PAYLOAD_OFF + n] = data
        sg.order_fence()
        self._next += 1
        seq[0] = self._next  # even: stable

    def read(self, timeout: float = 1.0) -> bytes:
        """A consistent copy of the latest snapshot (``b""`` before the first publish).

        Retries while the writer is mid-update; ``BoardBusy`` if no quiet moment came in ``timeout``.
        """
        seq, buf = self._seq, self._buf
        deadline = None
        while True:
            s1 = int(seq[0])
            if not s1 & 1:
                sg.order_fence()
                n = _LEN.unpack_from(buf, _LEN_OFF)[0]
                data = bytes(buf[_PAYLOAD_OFF : _PAYLOAD_OFF + min(n, self.capacity)])
                sg.order_fence()
                if int(seq[0]) == s1:
                    return data
            if deadline is None:
                deadline = time.monotonic() + timeout
            elif time.monotonic() > deadline:
                raise BoardBusy(f"board {self._seg.name} changed during every read for {timeout} s")
            time.sleep(0)

    @property
    def sequence(self) -> int:
        """Number of completed publishes (a reader can tell a stale board from a live one)."""
        return int(self._seq[0]) // 2

    def writer_alive(self) -> bool:
        return self._seg.owner_alive()

    def close(self) -> None:
        """Unmap; the creator also unlinks the board."""
        if self._seg.closed:
            return
        self._seq = None
        self._buf = None
        self._seg.close()

    def __enter__(self) -> StatsBoard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def list_runs() -> list[str]:
    """Runs with a board in ``/dev/shm`` whose server is alive (for ``agentserve top --run``)."""
    runs = []
    head, tail = sg.PREFIX + "-", "-" + ROLE
    for entry in sg.list_segments(head):
        if not entry.endswith(tail):
            continue
        header = sg.read_header(entry)
        if header and header[0] == sg.KIND_BOARD and header[3] and sg.pid_alive(header[1], header[2]):
            runs.append(entry[len(head) : -len(tail)])
    return runs
