"""A lane thread's OpenMP workers follow its cores (``executor/partition/omp_team``) on real threads and masks."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import pytest
import torch

from agentserve.executor.partition.cpu_cores import CpuCoresBackend
from agentserve.executor.partition.omp_team import pin_team, shares_torch_runtime, team_masks
from agentserve.protocol.lanes import Lane


@pytest.fixture
def cores() -> tuple[int, int]:
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) < 2:
        pytest.skip("needs two cores")
    if team_masks(2) is None:
        pytest.skip("no CPU library (no C compiler or no OpenMP)")
    return usable[0], usable[1]


def in_thread(fn: Callable[[], None]) -> None:
    """Run ``fn`` on a fresh thread (its own OpenMP team and mask), re-raising what it raised."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    assert not t.is_alive()
    if errors:
        raise errors[0]


def test_the_cpu_library_shares_pytorchs_openmp_runtime(cores: tuple[int, int]) -> None:
    assert shares_torch_runtime(), "torch.set_num_threads is not visible to the library: pinning reaches no worker"


def test_a_worker_keeps_its_mask_when_its_thread_narrows_until_the_team_is_pinned(cores: tuple[int, int]) -> None:
    a, b = cores

    def body() -> None:
        tid = threading.get_native_id()
        os.sched_setaffinity(tid, {a, b})
        torch.set_num_threads(2)
        assert team_masks(2) == [{a, b}, {a, b}]
        os.sched_setaffinity(tid, {b})
        assert team_masks(2) == [{b}, {a, b}], "the premise: the worker kept the mask it was created with"
        assert pin_team((b,), 2)
        assert team_masks(2) == [{b}, {b}]
        x = torch.randn(512, 512)
        torch.mm(x, x)  # PyTorch's products run on that team: nothing re-creates or re-masks it
        assert team_masks(2) == [{b}, {b}]

    in_thread(body)


def test_a_team_of_one_thread_needs_no_pinning(cores: tuple[int, int]) -> None:
    assert not pin_team(cores, 1)


def test_the_prefill_lane_narrowing_takes_its_workers_off_decodes_core(cores: tuple[int, int]) -> None:
    a, b = cores
    cpu = CpuCoresBackend(cores=cores)

    def body() -> None:
        cpu._apply((a, b), 2)  # a wide step: the worker is created on both cores
        assert team_masks(2) == [{a, b}, {a, b}]
        cpu._apply((b,), 2)  # narrowed with two threads (on more cores: several on its own cores)
        assert team_masks(2) == [{b}, {b}]
        cpu._apply((a, b), 2)
        assert team_masks(2) == [{a, b}, {a, b}]

    try:
        in_thread(body)
    finally:
        cpu.close()


def test_binding_a_lane_pins_its_team_and_leaving_restores_it(cores: tuple[int, int]) -> None:
    a, b = cores
    cpu = CpuCoresBackend(cores=cores)
    top = cpu.ladder[-1]

    def body() -> None:
        tid = threading.get_native_id()
        os.sched_setaffinity(tid, {b})
        torch.set_num_threads(2)
        assert team_masks(2) == [{b}, {b}], "the worker is created on the thread's one core"
        with cpu.lane_context(Lane.PREFILL, top.index):
            assert team_masks(2) == [{a, b}, {a, b}]
        assert os.sched_getaffinity(tid) == {b} and team_masks(2) == [{b}, {b}]

    try:
        in_thread(body)
    finally:
        cpu.close()
