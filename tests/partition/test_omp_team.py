"""A lane thread's OpenMP workers follow its cores (``executor/partition/omp_team``) on real threads and masks."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import pytest
import torch

from agentserve.executor.partition.base import LaneBinding
from agentserve.executor.partition.cpu_cores import CpuCoresBackend, usable_cores
from agentserve.executor.partition.omp_team import pin_team, release_team, shares_torch_runtime, team_masks
from agentserve.protocol.lanes import OPENMP_BINDING_ENV, Lane, openmp_binding


@pytest.fixture
def cores() -> tuple[int, int]:
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) < 2:
        pytest.skip("needs two cores")
    if team_masks(2) is None:
        pytest.skip("no CPU library (no C compiler or no OpenMP)")
    return usable[0], usable[1]


@pytest.fixture
def cpu(cores: tuple[int, int]) -> Iterator[CpuCoresBackend]:
    backend = CpuCoresBackend(cores=cores)
    yield backend
    backend.close()


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


def test_a_team_is_pinned_one_core_per_thread_unless_asked_to_share_the_set(cores: tuple[int, int]) -> None:
    """A worker started beside its thread stays on that thread's core until the kernel balances, while the other
    core idles: pinned one per core, the two halves of a product never share a core."""
    a, b = cores

    def body() -> None:
        torch.set_num_threads(2)
        assert pin_team((b, a), 2)
        assert team_masks(2) == [{b}, {a}]
        assert os.sched_getaffinity(threading.get_native_id()) == {b}
        assert pin_team((a, b), 2, one_core_each=False)
        assert team_masks(2) == [{a, b}, {a, b}]
        assert pin_team((a,), 2)  # more threads than cores: they take turns on them
        assert team_masks(2) == [{a}, {a}]

    in_thread(body)


def test_a_team_of_one_thread_needs_no_pinning(cores: tuple[int, int]) -> None:
    assert not pin_team(cores, 1)


def test_the_prefill_lane_narrowing_takes_its_workers_off_decodes_core(
    cores: tuple[int, int], cpu: CpuCoresBackend
) -> None:
    a, b = cores

    def body() -> None:
        cpu._apply((a, b), 2)  # a wide step: the lane thread on its own core, the worker on decode's
        assert team_masks(2) == [{b}, {a}]
        cpu._apply((b,), 2)  # narrowed with two threads (on more cores: several on its own cores)
        assert team_masks(2) == [{b}, {b}]
        cpu._apply((a, b), 2)
        assert team_masks(2) == [{b}, {a}]

    in_thread(body)


def test_binding_a_lane_pins_its_team(cores: tuple[int, int], cpu: CpuCoresBackend) -> None:
    a, b = cores
    top = cpu.ladder[-1]

    def body() -> None:
        tid = threading.get_native_id()
        os.sched_setaffinity(tid, {b})
        torch.set_num_threads(2)
        assert team_masks(2) == [{b}, {b}], "the worker is created on the thread's one core"
        with cpu.lane_context(Lane.PREFILL, top.index):
            assert team_masks(2) == [{a, b}, {a, b}]
        assert os.sched_getaffinity(tid) == {b} and torch.get_num_threads() == 2

    in_thread(body)


def test_a_worker_parked_by_one_thread_steps_is_re_pinned_when_the_team_grows_again(
    cores: tuple[int, int], cpu: CpuCoresBackend
) -> None:
    a, b = cores

    def body() -> None:
        cpu._apply((a, b), 2)
        cpu._apply((b,), 1)  # one-thread regions leave the parked worker on both cores
        cpu._apply((b,), 2)  # the same cores, more threads
        assert team_masks(2) == [{b}, {b}]

    in_thread(body)


def test_pytorchs_own_workers_follow_the_lane(cores: tuple[int, int], cpu: CpuCoresBackend) -> None:
    """Seen from outside the library: every thread the lane's products started ends up on the lane's core."""
    a, b = cores
    before = {int(t) for t in os.listdir("/proc/self/task")}
    seen: dict[int, set[int]] = {}

    def body() -> None:
        x = torch.randn(512, 512)
        cpu._apply((a, b), 2)
        torch.mm(x, x)
        cpu._apply((b,), 2)
        torch.mm(x, x)
        new = (int(t) for t in os.listdir("/proc/self/task") if int(t) not in before)
        seen.update({t: os.sched_getaffinity(t) for t in new})

    in_thread(body)
    assert len(seen) >= 2, "the lane thread and a worker"
    assert all(mask == {b} for mask in seen.values()), seen


def test_the_runtime_check_leaves_pytorchs_thread_count_alone(cores: tuple[int, int]) -> None:
    def body() -> None:
        torch.set_num_threads(2)
        shares_torch_runtime.cache_clear()
        assert shares_torch_runtime()
        assert torch.get_num_threads() == 2

    in_thread(body)


@pytest.mark.parametrize(("environ", "binds"), [
    ({"OMP_PROC_BIND": "close"}, ["OMP_PROC_BIND=close"]),
    ({"OMP_PLACES": "cores", "HOME": "/x"}, ["OMP_PLACES=cores"]),
    ({"GOMP_CPU_AFFINITY": "0-3"}, ["GOMP_CPU_AFFINITY=0-3"]),
    ({"OMP_PROC_BIND": " FALSE ", "OMP_PLACES": "cores"}, []),  # binding off, whatever the others say
    ({}, []),
])
def test_which_settings_make_openmp_pin(environ: dict[str, str], binds: list[str]) -> None:
    assert openmp_binding(environ) == binds


def test_the_backend_says_when_openmp_pinned_the_process(monkeypatch, caplog) -> None:
    """The cores come from the first thread's mask, which libgomp narrowed as PyTorch loaded: say so."""
    caplog.set_level(logging.WARNING, logger="agentserve.executor.partition.cpu_cores")
    for name in OPENMP_BINDING_ENV:
        monkeypatch.delenv(name, raising=False)
    usable_cores()
    assert not caplog.records
    monkeypatch.setenv("OMP_PROC_BIND", "spread")
    usable_cores()
    assert "OMP_PROC_BIND=spread is set" in caplog.text


def tasks() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def started_since(before: set[int]) -> set[int]:
    """Threads of this process alive now that were not in ``before`` (threads of earlier tests may end meanwhile:
    a released worker leaves /proc/self/task a moment after its pool is ended)."""
    return tasks() - before


def test_release_team_ends_the_calling_threads_idle_workers(cores: tuple[int, int]) -> None:
    """Idle workers of any thread make libgomp cut every worker's spin-wait short (more managed threads than CPUs):
    a thread that will not run wide products for a while ends its own."""
    x = torch.randn(256, 256)

    def body() -> None:
        torch.set_num_threads(2)
        before = tasks()
        torch.mm(x, x)
        assert len(started_since(before)) == 1, "the premise: a two-thread product leaves one idle worker"
        assert release_team()
        assert not started_since(before)
        torch.mm(x, x)  # the next wide product starts a new one
        assert len(started_since(before)) == 1

    in_thread(body)


def test_a_wide_step_leaves_no_idle_worker_and_the_backend_ends_its_creators(cores: tuple[int, int]) -> None:
    a, b = cores
    x = torch.randn(256, 256)

    def body() -> None:
        torch.set_num_threads(2)
        before = tasks()
        torch.mm(x, x)  # as the executor's main thread loads the model
        cpu = CpuCoresBackend(cores=cores)
        try:
            assert not started_since(before)
            top = cpu.ladder[-1]
            with cpu.lane_context(Lane.DECODE, top.index) as binding:
                assert not started_since(before), "binding pinned a team, then ended it: its next step starts there"
                with cpu.step_scope(binding, 64):
                    torch.mm(x, x)
                    assert len(started_since(before)) == 1
                assert not started_since(before)
        finally:
            cpu.close()

    in_thread(body)


def test_the_prefill_lane_narrowed_to_one_thread_ends_its_worker(
    cores: tuple[int, int], cpu: CpuCoresBackend
) -> None:
    """Else, no longer throttled, the idle worker would spin for milliseconds on the core given back to decode."""
    a, b = cores
    x = torch.randn(256, 256)

    def body() -> None:
        before = tasks()
        cpu._apply((a, b), 2)
        torch.mm(x, x)
        assert len(started_since(before)) == 1
        cpu._apply((b,), 1)
        assert not started_since(before)

    in_thread(body)


def _on_the_prefill_lane(cpu: CpuCoresBackend, body: Callable[[Callable[[], AbstractContextManager[None]], set[int]],
                                                   None]) -> None:
    """Run ``body(step, threads)`` on a fresh thread bound to the shared rung's prefill lane: ``step()`` enters one
    borrowing step of 64 tokens that has run a two-thread product, ``threads`` the process's threads once bound."""
    x = torch.randn(256, 256)

    @contextmanager
    def step_of(binding: LaneBinding) -> Iterator[None]:
        with cpu.step_scope(binding, 64):
            torch.mm(x, x)
            yield

    def run() -> None:
        with cpu.lane_context(Lane.PREFILL, cpu.ladder[-1].index) as binding:
            body(lambda: step_of(binding), tasks())

    in_thread(run)


def test_the_prefill_lane_keeps_its_worker_parked_on_decodes_core_between_borrowing_steps(
    cores: tuple[int, int], cpu: CpuCoresBackend
) -> None:
    """A new worker per step started beside the lane thread and took ~1 ms to reach its own core; kept, it sleeps
    after its short spin and the next wide step wakes it where it is."""
    a, b = cores  # decode's core, the prefill lane's

    def body(step: Callable[[], AbstractContextManager[None]], before: set[int]) -> None:
        with step():
            assert team_masks(2) == [{b}, {a}]
        worker = started_since(before)
        assert len(worker) == 1, "the step's worker outlives it"
        assert os.sched_getaffinity(threading.get_native_id()) == {b} and torch.get_num_threads() == 1
        with step():
            assert started_since(before) == worker, "the next step runs on the same worker"
            assert team_masks(2) == [{b}, {a}]
        release_team()

    _on_the_prefill_lane(cpu, body)


def test_beside_a_decode_lane_of_several_cores_the_prefill_lane_ends_its_workers_after_each_step(
    cores: tuple[int, int], cpu: CpuCoresBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """There decode's own workers and the parked ones together would outnumber the cores (every barrier sleeps)."""
    monkeypatch.setattr(cpu, "_decode_home", cores)  # as if decode's partition had two cores

    def body(step: Callable[[], AbstractContextManager[None]], before: set[int]) -> None:
        with step():
            assert len(started_since(before)) == 1
        assert not started_since(before)

    _on_the_prefill_lane(cpu, body)
