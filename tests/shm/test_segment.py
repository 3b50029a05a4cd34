"""Segment lifecycle: names, the size-0 race, stale cleanup, SIGTERM / exit cleanup (and `up`'s forced stop),
resource_tracker."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import posix_ipc
import pytest
from shm_helpers import ours

from agentserve.shm import segment as sg
from agentserve.shm.board import StatsBoard
from agentserve.shm.channel import RingPair
from agentserve.shm.errors import SegmentError, SegmentNotFound

FORK = mp.get_context("fork")


def test_names_are_validated_and_parse_back():
    assert sg.shm_name("my-run_1", "exec0_dec") == "/agentserve-my-run_1-exec0_dec"
    assert sg.sem_name("r", "board", "data") == "/agentserve-r-board.data"
    for bad_run, bad_role in [("a/b", "x"), ("", "x"), ("r", "a-b"), ("r", "a.b"), ("r" * 65, "x")]:
        with pytest.raises(ValueError):
            sg.shm_name(bad_run, bad_role)


def test_attacher_waits_through_size_zero_and_unready_header(run):
    name = sg.shm_name(run, "slow")
    got: list = []
    t = threading.Thread(target=lambda: got.append(sg.Segment.attach(name, sg.KIND_BOARD, timeout=10)))
    t.start()
    raw = posix_ipc.SharedMemory(name, posix_ipc.O_CREX)  # exists, size 0: what a racing attacher sees
    try:
        time.sleep(0.1)
        assert t.is_alive() and not got
        os.ftruncate(raw.fd, sg.HEADER_SIZE + 64)
        seg = sg.Segment(name, __import__("mmap").mmap(raw.fd, sg.HEADER_SIZE + 64), owner=True)
        sg._HEADER.pack_into(seg.buf, 0, sg.MAGIC, sg.HEADER_VERSION, sg.KIND_BOARD, os.getpid(), 0, seg.size)
        time.sleep(0.1)
        assert t.is_alive() and not got  # sized and headed but not ready yet
        seg.mark_ready()
        t.join(5)
        assert len(got) == 1 and got[0].owner_pid == os.getpid()
        got[0].close()
        seg.close()
    finally:
        raw.close_fd()
        sg._unlink_shm(name)


def test_attach_timeout_and_wrong_kind_are_typed_errors(run):
    with pytest.raises(SegmentNotFound):
        sg.Segment.attach(sg.shm_name(run, "nothing"), sg.KIND_RING, timeout=0.05)
    with StatsBoard.create(run, 64, version=1), pytest.raises(SegmentError, match="kind 1"):
        sg.Segment.attach(sg.shm_name(run, "board"), sg.KIND_RING, timeout=1)


def _crash_leaving_segments(run: str) -> None:
    RingPair.create(run, slots=2, slot_size=64)
    StatsBoard.create(run, 64, version=1)
    os.kill(os.getpid(), signal.SIGKILL)


def test_cleanup_stale_removes_a_dead_runs_leftovers_only(run):
    p = FORK.Process(target=_crash_leaving_segments, args=(run + "dead",))
    p.start()
    p.join()
    assert p.exitcode == -signal.SIGKILL
    dead = ours(run + "dead")
    assert len(dead) == 2 * 3 + 1  # two rings with two semaphores each, one board
    with RingPair.create(run + "live", slots=2, slot_size=64):
        live = ours(run + "live")
        removed = sg.cleanup_stale(f"/agentserve-{run}")  # covers both runs, nobody else's
        assert sorted(n.lstrip("/") for n in removed) == sorted(
            n.removeprefix("sem.") for n in dead
        )
        assert ours(run + "dead") == [] and ours(run + "live") == live


def _run_python(code: str, timeout: float = 60) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-W", "error", "-c", textwrap.dedent(code)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_sigterm_unlinks_everything_the_process_created(run):
    proc = _run_python(f"""
        import time
        from agentserve.shm.channel import RingPair
        from agentserve.shm.board import StatsBoard
        pair = RingPair.create({run!r}, slots=2, slot_size=64)
        board = StatsBoard.create({run!r}, 64, version=1)
        print("up", flush=True)
        time.sleep(60)
    """)
    assert proc.stdout.readline().strip() == "up"
    assert len(ours(run)) == 7
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGTERM
    assert ours(run) == [] and err == ""


def test_exit_cleans_up_and_resource_tracker_never_runs(run):
    proc = _run_python(f"""
        from multiprocessing import resource_tracker
        from agentserve.shm.channel import RingPair
        from agentserve.shm.board import StatsBoard
        from agentserve.protocol.ring_messages import Shutdown
        pair = RingPair.create({run!r}, slots=2, slot_size=64)
        peer = RingPair.attach({run!r})
        pair.send(Shutdown("x"))
        assert peer.recv() == Shutdown("x")
        peer.close()
        board = StatsBoard.create({run!r}, 64, version=1)
        board.publish(b"x")
        assert resource_tracker._resource_tracker._pid is None, "resource_tracker was started"
        # no close(): the atexit hook must unlink
    """)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert err == "" and out == ""
    assert ours(run) == []


def test_a_forked_child_does_not_unlink_its_parents_segments(run):
    with RingPair.create(run, slots=2, slot_size=64):
        before = ours(run)
        p = FORK.Process(target=sg.run_cleanups)
        p.start()
        p.join()
        assert p.exitcode == 0 and ours(run) == before


def test_a_forced_stop_landing_while_the_clean_up_holds_the_registry_lock_still_removes_everything(run):
    """`up`'s forced stop (a second signal during the clean-up) runs the clean-ups from a signal handler, in the
    main thread, which may hold the registry's lock just then (closing a ring unregisters its segments): a plain
    lock deadlocked there, and every later signal's handler with it, so only SIGKILL ended the process."""
    proc = _run_python(f"""
        import os, signal, time
        from agentserve.cli.up_signals import ForcedStop
        from agentserve.shm import segment
        from agentserve.shm.channel import RingPair
        pair = RingPair.create({run!r}, slots=2, slot_size=64)
        ForcedStop(lambda: [], None).arm()
        with segment._cleanup_lock:  # as in unregister_cleanup
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)
    """)
    try:
        _out, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        sg.cleanup_stale(f"/agentserve-{run}")
        pytest.fail("the forced stop deadlocked")
    assert proc.returncode == 128 + signal.SIGINT, err
    assert ours(run) == []


def test_a_third_signal_during_the_forced_stop_does_not_cut_its_removals_short(run):
    """The forced stop takes every name off the registry, then removes them one by one; a third Ctrl-C landing
    meanwhile ran the forced stop again, which found the registry empty and exited at once: the names the first
    had not removed yet stayed in /dev/shm for good."""
    proc = _run_python(f"""
        import os, signal, time
        from agentserve.cli.up_signals import ForcedStop
        from agentserve.shm import segment
        from agentserve.shm.channel import RingPair
        segment.register_cleanup("a third signal", lambda: os.kill(os.getpid(), signal.SIGINT))  # removed first
        pair = RingPair.create({run!r}, slots=2, slot_size=64)
        ForcedStop(lambda: [], None).arm()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    """)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert ours(run) == []
