"""ExecutorLink.restart loads an executor on a thread and reports through the queue; stop() cancels a
restart that is still loading (the loading process is killed, its rings removed)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from types import SimpleNamespace

import pytest

from agentserve.executor.builtin import resolve_model
from agentserve.orchestrator.executor_link import (
    ExecutorDown,
    ExecutorLink,
    ExecutorSpec,
    ExecutorStartError,
    Restarted,
    RestartFailed,
)
from agentserve.orchestrator.limits import HangRule
from agentserve.protocol.ring_messages import Release


def _link(hang: HangRule | None = None) -> ExecutorLink:
    spec = ExecutorSpec(f"t{uuid.uuid4().hex[:8]}", str(resolve_model("tiny")), ["--dtype", "float32",
                                                                               "--num-blocks", "64"])
    return ExecutorLink(spec, hang)


def _ours(run: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if run in n]


def test_restart_reports_ready_through_the_queue() -> None:
    link = _link()
    try:
        link.restart()
        deadline = time.monotonic() + 120
        got: list[object] = []
        while not got:
            assert time.monotonic() < deadline, "no Restarted within 120 s"
            time.sleep(0.05)
            got = link.drain()
        (msg,) = got
        assert isinstance(msg, Restarted) and msg.ready is link.ready and link.ready.num_blocks == 64
    finally:
        link.close()
    assert not _ours(link.spec.run)


@pytest.mark.parametrize("after_s", [0.0, 0.3])  # before the thread spawned it / while it imports torch
def test_stop_cancels_a_restart_still_loading(after_s: float) -> None:
    link = _link()
    link.restart()
    time.sleep(after_s)
    link.stop()
    alive = subprocess.run(["pgrep", "-f", link.spec.run], capture_output=True, text=True).stdout.split()
    assert not alive, "the loading executor was left running"
    (msg,) = link.drain()
    assert isinstance(msg, RestartFailed) and "cancelled" in msg.reason
    link.close()
    assert not _ours(link.spec.run)


def test_any_failure_of_a_restart_is_reported(monkeypatch) -> None:
    link = _link()

    def boom(timeout, progress):
        raise RuntimeError("unexpected")

    monkeypatch.setattr(link, "_launch", boom)
    link.restart()
    link._starter.join(10)
    (msg,) = link.drain()
    assert isinstance(msg, RestartFailed) and msg.reason == "RuntimeError: unexpected"
    link.close()


@pytest.mark.parametrize("set_here, expected", [
    ({}, "20000"),  # ours: idle workers spin ~0.5 ms, not libgomp's ~7 ms
    ({"GOMP_SPINCOUNT": "100"}, "100"),  # the user's, kept
    ({"OMP_WAIT_POLICY": "ACTIVE"}, None),  # a wait policy of the user's: nothing added
])
def test_the_executor_gets_a_short_openmp_spin_unless_the_environment_sets_one(monkeypatch, set_here, expected):
    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in set_here.items():
        monkeypatch.setenv(name, value)
    env = ExecutorSpec("t", "m").env()
    assert env.get("GOMP_SPINCOUNT") == expected
    assert env.get("OMP_WAIT_POLICY") == set_here.get("OMP_WAIT_POLICY")


def test_the_executor_starts_without_openmp_binding(monkeypatch) -> None:
    """With OMP_PROC_BIND / OMP_PLACES in the environment, OpenMP would pin the executor's first thread to one core
    as PyTorch loads, and the cpu-cores backend would see that core only: one unpartitioned rung."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two usable cores")
    monkeypatch.setenv("OMP_PROC_BIND", "close")
    monkeypatch.setenv("OMP_PLACES", "cores")
    spec = ExecutorSpec(f"t{uuid.uuid4().hex[:8]}", str(resolve_model("tiny")),
                        ["--dtype", "float32", "--num-blocks", "64", "--partition", "cpu-cores"])
    assert not set(spec.env()) & {"OMP_PROC_BIND", "OMP_PLACES"}
    link = ExecutorLink(spec)
    try:
        ready = link.start(timeout=120)
        assert any(r.partitioned for r in ready.ladder), f"one core seen: {ready.reason}"
    finally:
        link.close()
    assert not _ours(spec.run)


def _drain_until(link: ExecutorLink, deadline_s: float) -> list[object]:
    got: list[object] = []
    deadline = time.monotonic() + deadline_s
    while not got and time.monotonic() < deadline:
        time.sleep(0.05)
        got = link.drain()
    return got


def test_the_load_bound_comes_from_the_limits_and_a_late_executor_is_killed() -> None:
    """``limits.executor.load_timeout_s`` bounds start and restart alike (the tiny model takes seconds to load)."""
    link = _link(HangRule(load_timeout_s=0.3))
    try:
        t0 = time.monotonic()
        with pytest.raises(ExecutorStartError, match=r"not ready after 0.3 s \(limits.executor.load_timeout_s\)"):
            link.start()
        assert time.monotonic() - t0 < 5
        assert link.proc.wait(timeout=10) != 0  # killed, not left loading
        link.restart()
        got = _drain_until(link, 10)
        assert len(got) == 1 and isinstance(got[0], RestartFailed) and "load_timeout_s" in got[0].reason, got
    finally:
        link.close()
    assert not _ours(link.spec.run)


def test_an_executor_that_exits_by_itself_is_reported_down() -> None:
    """On SIGTERM the executor closes its rings as it leaves: that is the executor going down, not our stop()."""
    link = _link()
    try:
        link.start()
        link.proc.send_signal(signal.SIGTERM)
        got = _drain_until(link, 30)
        assert len(got) == 1 and isinstance(got[0], ExecutorDown), got
        assert "closed its rings" in got[0].reason and "exited with code" in got[0].reason, got[0].reason
        link.send(Release([1]))  # the executor is gone: dropped, not raised (the ExecutorDown above says why)
    finally:
        link.close()
    assert not _ours(link.spec.run)


def test_stop_is_not_reported_as_the_executor_going_down() -> None:
    link = _link()
    link.start()
    reader = link._reader
    link.stop()
    assert reader is not None and not reader.is_alive()
    assert link.drain() == []
    link.close()
    assert not _ours(link.spec.run)


def test_results_waiting_in_the_inbox_are_not_a_hang() -> None:
    """The loop may be busy for longer than the hang bound (tokenising a huge prompt): results the reader thread
    received meanwhile, not yet drained, show the executor is alive, so it is not killed."""
    now = [100.0]
    link = ExecutorLink(ExecutorSpec("unused", "unused", []), clock=lambda: now[0])
    killed: list[bool] = []
    link.proc = SimpleNamespace(poll=lambda: None, kill=lambda: killed.append(True), pid=1)
    link.watch.sent(1, now[0])
    now[0] += 60.0
    link._heard = now[0] - 1.0  # a result came in a second ago and waits to be drained
    assert link.check_hung() is None and not killed
    link._heard = 100.0  # nothing heard since the plan went out
    assert link.check_hung() is not None and killed
    link.proc = None
    link.close()


def test_a_send_to_a_stopped_executor_ends_in_executor_down() -> None:
    """A SIGSTOPped executor reads no decisions: once the ring is full, a send waits at most the hang bound, then
    the executor is killed as hung (the loop would otherwise block in that send for good)."""
    spec = ExecutorSpec(f"t{uuid.uuid4().hex[:8]}", str(resolve_model("tiny")), ["--dtype", "float32",
                                                                                "--num-blocks", "64"])
    link = ExecutorLink(spec, HangRule(hang_floor_s=1.0))
    try:
        link.start()
        link.proc.send_signal(signal.SIGSTOP)
        slowest = 0.0
        for _ in range(100_000):
            t0 = time.monotonic()
            link.send(Release([1]))
            slowest = time.monotonic() - t0
            if slowest > 0.5:
                break
        assert 0.9 < slowest < 5.0, f"the send that found the ring full took {slowest:.2f} s"
        t0 = time.monotonic()
        link.send(Release([1]))  # killed as hung: dropped at once
        assert time.monotonic() - t0 < 0.1
        got = _drain_until(link, 30)
        assert len(got) == 1 and isinstance(got[0], ExecutorDown), got
        assert "decision ring stayed full" in got[0].reason, got[0].reason
    finally:
        link.close()
    assert not _ours(link.spec.run)
