"""Typed errors of the shared-memory layer.

Everything raised by :mod:`agentserve.shm` on purpose derives from :class:`ShmError`, so a caller
can tell "the channel failed" from a bug.  :class:`CorruptFrame` also derives from
``messages.DecodeError`` so that one ``except DecodeError`` covers every undecodable slot.
"""

from __future__ import annotations

from agentserve.protocol.ring_messages import DecodeError


class ShmError(Exception):
    """Base of every error raised on purpose by the shared-memory layer."""


class SegmentError(ShmError):
    """A segment could not be created, attached or is not what it claims to be."""


class SegmentNotFound(SegmentError, FileNotFoundError):
    """No segment of that name appeared (and became ready) before the timeout."""


class RingTimeout(ShmError, TimeoutError):
    """A ring operation did not complete before its timeout (full ring on put, empty ring on get)."""


class MessageTooLarge(ShmError, ValueError):
    """A message does not fit in one slot. It is rejected, never truncated."""

    def __init__(self, size: int, slot_size: int) -> None:
        super().__init__(f"message of {size} bytes does not fit in a ring slot of {slot_size} bytes")
        self.size = size
        self.slot_size = slot_size


class PeerDied(ShmError):
    """The process at the other end of a ring is gone (found while waiting on it)."""

    def __init__(self, role: str, pid: int) -> None:
        super().__init__(f"peer {role} (pid {pid}) died")
        self.role = role
        self.pid = pid


class RingClosed(ShmError):
    """The ring was closed (by this side or by the peer); nothing more will arrive or be taken."""


class CorruptFrame(ShmError, DecodeError):
    """A slot's frame (flag byte or length) holds a value the protocol never writes."""


class BoardVersionMismatch(ShmError):
    """The stats board was written with another snapshot layout than this reader understands."""

    def __init__(self, found: int, expected: int) -> None:
        super().__init__(
            f"stats board layout version {found} but this reader understands version {expected}"
            " (server and reader come from different agentserve versions)"
        )
        self.found = found
        self.expected = expected


class BoardBusy(ShmError, TimeoutError):
    """No consistent snapshot could be read before the timeout (the writer never paused)."""
