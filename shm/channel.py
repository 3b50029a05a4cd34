"""The orchestrator ⇄ executor channel: a decision ring one way and a result ring back.

The orchestrator (owner) creates both rings, the executor attaches::

    # orchestrator
    pair = RingPair.create(run, "exec0")             # /agentserve-<run>-exec0_dec, …-exec0_res
    proc = subprocess.Popen([... "--run", run ...])
    pair.expect_peer(proc.pid)                        # PeerDied even if it dies before attaching
    ready = pair.recv(timeout=300)                    # Ready
    pair.send(Plan(...))
    ...
    pair.close()                                      # unlinks everything

    # executor
    pair = RingPair.attach(run, "exec0")
    pair.send(Ready(...))
    while not isinstance(msg := pair.recv(), Shutdown): ...
    pair.close()

``send`` encodes with the direction's reused :class:`~agentserve.protocol.ring_messages.Codec`, ``recv``
decodes straight from the slot.  Errors: see :mod:`agentserve.shm.errors`.
"""

from __future__ import annotations

import msgspec

from agentserve.protocol.ring_messages import from_executor_codec, to_executor_codec

from .ring import DEFAULT_SPIN_S, RingReader, RingWriter

DEFAULT_SLOTS = 64
DEFAULT_SLOT_SIZE = 128 * 1024  # a prefill chunk of 8k tokens plus 64 decode rows fits


class RingPair:
    """Both rings of one orchestrator ⇄ executor link, seen from one side."""

    def __init__(self, tx: RingWriter, rx: RingReader) -> None:
        self.tx = tx
        self.rx = rx

    @classmethod
    def create(
        cls,
        run: str,
        role_prefix: str = "exec0",
        slots: int = DEFAULT_SLOTS,
        slot_size: int = DEFAULT_SLOT_SIZE,
        spin_s: float = DEFAULT_SPIN_S,
    ) -> RingPair:
        """The orchestrator's side: creates ``<role_prefix>_dec`` (it writes) and ``_res`` (it reads)."""
        tx = RingWriter.create(run, f"{role_prefix}_dec", slots, slot_size, to_executor_codec(), spin_s)
        try:
            rx = RingReader.create(run, f"{role_prefix}_res", slots, slot_size, from_executor_codec(), spin_s)
        except BaseException:
            tx.close()
            raise
        return cls(tx, rx)

    @classmethod
    def attach(
        cls, run: str, role_prefix: str = "exec0", timeout: float = 10.0, spin_s: float = DEFAULT_SPIN_S
    ) -> RingPair:
        """The executor's side: reads ``<role_prefix>_dec``, writes ``<role_prefix>_res``."""
        rx = RingReader.attach(run, f"{role_prefix}_dec", to_executor_codec(), timeout, spin_s)
        try:
            tx = RingWriter.attach(run, f"{role_prefix}_res", from_executor_codec(), timeout, spin_s)
        except BaseException:
            rx.close()
            raise
        return cls(tx, rx)

    def send(self, msg: msgspec.Struct, timeout: float | None = None) -> None:
        self.tx.put(msg, timeout)

    def recv(self, timeout: float | None = None) -> msgspec.Struct:
        return self.rx.get(timeout)

    def poll(self) -> bool:
        """Whether :meth:`recv` would return without waiting."""
        return self.rx.poll()

    @property
    def pid(self) -> int:
        return self.tx.pid

    @property
    def peer_pid(self) -> int:
        return self.rx.peer_pid or self.tx.peer_pid

    def expect_peer(self, pid: int) -> None:
        """Watch ``pid`` for death on both rings until the peer attaches."""
        self.tx.expect_peer(pid)
        self.rx.expect_peer(pid)

    def peer_alive(self) -> bool:
        return self.tx.peer_alive() and self.rx.peer_alive()

    def shutdown(self) -> None:
        """Wake every waiter (here and in the peer) with ``RingClosed``; thread- and signal-safe."""
        self.tx.shutdown()
        self.rx.shutdown()

    def close(self) -> None:
        self.tx.close()
        self.rx.close()

    def __enter__(self) -> RingPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
