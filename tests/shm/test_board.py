"""Stats board: publish/read, versioning, discovery, and no torn snapshot under a hammering writer."""

from __future__ import annotations

import multiprocessing as mp
import zlib

import msgspec
import pytest

from agentserve.shm.board import StatsBoard, list_runs
from agentserve.shm.errors import BoardVersionMismatch, MessageTooLarge
from agentserve.shm.segment import cleanup_stale

FORK = mp.get_context("fork")
CAPACITY = 64 * 1024


class Snap(msgspec.Struct, array_like=True):
    """A test snapshot that can prove itself whole: the counter three times and a checksum."""

    n: int
    rows: list[int]
    n_again: int
    crc: int


def snap(n: int) -> bytes:
    rows = [n * 7 + k for k in range(n % 3000)]  # sizes vary from 10 bytes to ~15 KiB
    crc = zlib.crc32(msgspec.msgpack.encode(rows))
    return msgspec.msgpack.encode(Snap(n, rows, n, crc))


def whole(data: bytes) -> Snap:
    s = msgspec.msgpack.decode(data, type=Snap)
    assert s.n == s.n_again and s.crc == zlib.crc32(msgspec.msgpack.encode(s.rows)), "torn snapshot"
    assert s.rows == [s.n * 7 + k for k in range(s.n % 3000)], "torn snapshot"
    return s


def test_publish_then_read(run):
    with StatsBoard.create(run, 256, version=3) as board, StatsBoard.attach(run, version=3) as reader:
        assert reader.read() == b"" and reader.sequence == 0
        board.publish(b"first")
        board.publish(b"second, longer")
        assert reader.read() == b"second, longer" and reader.sequence == 2
        assert reader.writer_alive()
        with pytest.raises(MessageTooLarge, match="257 bytes .* 256 bytes"):
            board.publish(b"x" * 257)


def test_a_reader_of_another_layout_version_fails_clearly(run):
    with StatsBoard.create(run, 64, version=2), pytest.raises(BoardVersionMismatch, match="version 2 .* version 3"):
        StatsBoard.attach(run, version=3)


def test_list_runs_finds_live_boards(run):
    assert run not in list_runs()
    with StatsBoard.create(run, 64, version=1):
        assert run in list_runs()
    assert run not in list_runs()


def hammer(run: str) -> None:
    board = StatsBoard.create(run, CAPACITY, version=1)
    n = 0
    while True:  # until killed
        n += 1
        board.publish(snap(n))


def test_readers_never_see_a_torn_snapshot(run):
    p = FORK.Process(target=hammer, args=(run,), daemon=True)
    p.start()
    try:
        reader = StatsBoard.attach(run, version=1, timeout=10)
        try:
            seen, last = set(), 0
            for _ in range(3000):
                data = reader.read(timeout=5)
                if data:
                    s = whole(data)
                    assert s.n >= last, "a snapshot older than one already read"
                    last = s.n
                    seen.add(s.n)
            assert len(seen) > 1, "the writer never published while we read"
        finally:
            reader.close()
    finally:
        p.kill()
        p.join()
        assert cleanup_stale(f"/agentserve-{run}") == [f"/agentserve-{run}-board"]  # killed: no unlink
