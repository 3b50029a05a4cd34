"""Where the cpu-cores backend puts the decode helper (``executor/fused/helper.py``) and when it lends it: on the
cores decode's home rung leaves to prefill, to the decode lane's one-thread steps, never while a prefill lane step
runs.  Affinity calls are recorded, not made, so two cores are pretended on any machine."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from agentserve.executor.partition.cpu_cores import CpuCoresBackend
from agentserve.executor.partition.omp_team import release_team
from agentserve.protocol.lanes import Lane


class FakeHelper:
    """What the backend uses of a DecodeHelper: its cores once started, and the allow calls."""

    def __init__(self) -> None:
        self.cores: tuple[int, ...] = ()
        self.allowed: list[bool] = []

    def start(self, cores) -> None:
        self.cores = tuple(cores)

    def allow(self, allowed: bool) -> None:
        self.allowed.append(allowed)


@pytest.fixture
def two_cores(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[CpuCoresBackend, dict[int, tuple[int, ...]]]]:
    pinned: dict[int, tuple[int, ...]] = {}
    real_mask, real_setaffinity = os.sched_getaffinity(0), os.sched_setaffinity
    monkeypatch.setattr(os, "sched_getaffinity", lambda tid: {0, 1})
    monkeypatch.setattr(os, "sched_setaffinity", lambda tid, cores: pinned.__setitem__(tid, tuple(sorted(cores))))
    cpu = CpuCoresBackend(cores=[0, 1])
    yield cpu, pinned
    real_setaffinity(0, real_mask)
    release_team()


def test_the_helper_runs_on_the_cores_decode_leaves_and_shares_one_thread_decode_steps(two_cores) -> None:
    cpu, pinned = two_cores
    helper = FakeHelper()
    assert cpu.attach_decode_helper(helper) and helper.cores == (1,)
    assert not cpu.attach_decode_helper(FakeHelper()), "one helper per backend"
    home = next(r for r in cpu.ladder if r.partitioned)
    tid = threading.get_native_id()
    with ExitStack() as stack:
        decode = stack.enter_context(cpu._bind(Lane.DECODE, home))
        for tokens in (1, 4, 32):  # decode's home is one core: every step runs on one thread
            with cpu.step_scope(decode, tokens) as got:
                assert got is helper and pinned[tid] == (0,)
    with ExitStack() as stack:  # the top rung: the lane thread runs a shared step beside the helper, not on its core
        decode = stack.enter_context(cpu._bind(Lane.DECODE, cpu.ladder[-1]))
        assert pinned[tid] == (0, 1)
        with cpu.step_scope(decode, 2) as got:
            assert got is helper and pinned[tid] == (0,)
        assert pinned[tid] == (0, 1)
        with cpu.step_scope(decode, 64) as got:  # two OpenMP threads: no helper, no pinning
            assert got is None and pinned[tid] == (0, 1)
    assert helper.allowed == []


def test_a_prefill_lane_step_keeps_the_helper_off_until_it_ends(two_cores) -> None:
    """A preempting step nested inside a chunk does not let the helper back before the chunk ends."""
    cpu, _ = two_cores
    helper = FakeHelper()
    assert cpu.attach_decode_helper(helper)
    home = next(r for r in cpu.ladder if r.partitioned)
    for rung in (home, cpu.ladder[-1]):
        helper.allowed.clear()
        with ExitStack() as stack:
            prefill = stack.enter_context(cpu._bind(Lane.PREFILL, rung))
            with cpu.step_scope(prefill, 256) as got:
                assert got is None and helper.allowed == [False]
                with cpu.step_scope(prefill, 56):
                    pass
                assert helper.allowed == [False, False], "the chunk still runs"
            assert helper.allowed == [False, False, True]


def test_no_helper_without_a_core_to_spare(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_setaffinity", lambda tid, cores: None)
    cpu = CpuCoresBackend(cores=[0])
    helper = FakeHelper()
    assert not cpu.attach_decode_helper(helper) and helper.cores == ()
