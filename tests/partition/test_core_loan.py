"""The core loan: a shared-rung prefill step runs on decode's cores only while decode is idle."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from agentserve.executor.lanes import LaneWorker
from agentserve.executor.layer_hook import between_layers
from agentserve.executor.partition.core_loan import CoreLoan
from agentserve.executor.partition.cpu_cores import CpuCoresBackend
from agentserve.executor.partition.omp_team import release_team, team_masks
from agentserve.protocol.lanes import Lane


def test_prefill_borrows_only_once_decode_has_been_idle_long_enough() -> None:
    now = [100.0]
    loan = CoreLoan(widen_after_s=0.01, clock=lambda: now[0])
    assert loan.try_borrow() and loan.lent, "decode never ran: the cores are free"
    loan.give_back()
    with loan.decode_step() as returned:
        assert returned
        assert not loan.try_borrow(), "never while a decode step runs"
    now[0] += 0.005
    assert not loan.try_borrow() and not loan.lent, "a pause shorter than widen_after_s is within a burst"
    now[0] += 0.006
    assert loan.try_borrow() and loan.borrows == 2


def test_a_step_planned_with_nothing_decoding_borrows_at_once_until_decode_runs_again() -> None:
    """``burst_ended`` (``Plan.decode_idle``): the decode step that ended a moment ago ended its burst, so the cores
    are lent now; a decode step after that (running, or ended within ``widen_after_s``) wants them back as before."""
    now = [100.0]
    loan = CoreLoan(widen_after_s=0.01, clock=lambda: now[0])
    with loan.decode_step():
        pass
    now[0] += 0.002
    assert not loan.try_borrow(), "premise: within widen_after_s of a decode step"
    loan.burst_ended()
    assert loan.try_borrow() and not loan.wanted_back(), "lent at once, and not asked back"
    loan.give_back()
    with loan.decode_step():
        assert loan.wanted_back()
    now[0] += 0.002
    assert loan.wanted_back() and not loan.try_borrow(), "a decode step after it starts a burst again"
    now[0] += 0.01
    assert loan.try_borrow() and loan.borrows == 2


def test_a_decode_step_waits_until_the_cores_come_back() -> None:
    loan = CoreLoan(widen_after_s=0.0, return_timeout_s=10.0)
    assert loan.try_borrow()
    entered = threading.Event()
    out: list[bool] = []

    def decode() -> None:
        with loan.decode_step() as returned:
            out.append(returned)
            entered.set()

    t = threading.Thread(target=decode)
    t.start()
    assert not entered.wait(0.1), "decode ran on lent cores"
    assert loan.wanted_back()
    loan.give_back()
    assert entered.wait(10)
    t.join(10)
    assert out == [True] and loan.late_returns == 0
    assert loan.waits == 1 and loan.wait_s >= 0.1, "the step's wait is tallied"


def test_a_held_step_waits_for_the_running_decode_step_then_keeps_the_cores_to_its_end() -> None:
    """A resume takes decode's cores even while agents decode: after the decode step running now, never inside it,
    and decode's next step waits for the whole held step, past the layer-boundary return timeout."""
    loan = CoreLoan(widen_after_s=10.0, return_timeout_s=0.05, hold_timeout_s=10.0)
    in_decode, decode_may_end, held = threading.Event(), threading.Event(), threading.Event()
    order: list[str] = []

    def decode_steps() -> None:
        with loan.decode_step():
            in_decode.set()
            decode_may_end.wait(10)
            order.append("decode 1 ends")
        with loan.decode_step() as returned:
            order.append(f"decode 2 ({returned})")

    def prefill() -> None:
        loan.hold()
        order.append("hold taken")
        held.set()
        assert loan.lent and loan.held
        assert not loan.try_borrow() or loan.lent  # holding: no second borrow needed
        time.sleep(0.2)  # longer than return_timeout_s: a held step is not cut short
        order.append("hold ends")
        loan.end_hold()
        loan.give_back()

    d = threading.Thread(target=decode_steps)
    d.start()
    assert in_decode.wait(10)
    assert not loan.try_borrow(), "premise: decode is busy, a plain borrow fails"
    p = threading.Thread(target=prefill)
    p.start()
    assert not held.wait(0.1), "the hold came inside a running decode step"
    decode_may_end.set()
    d.join(10)
    p.join(10)
    assert order == ["decode 1 ends", "hold taken", "hold ends", "decode 2 (True)"]
    assert loan.holds == 1 and loan.late_returns == 0 and not loan.lent


def test_a_decode_step_runs_anyway_once_the_return_is_late() -> None:
    loan = CoreLoan(widen_after_s=0.0, return_timeout_s=0.05)
    assert loan.try_borrow()
    t0 = time.monotonic()
    with loan.decode_step() as returned:
        assert not returned and time.monotonic() - t0 >= 0.05
    assert loan.late_returns == 1 and loan.waits == 1
    loan.give_back()
    with loan.decode_step() as returned:  # nothing lent: no wait to tally
        assert returned
    assert loan.waits == 1


def test_decode_never_runs_while_prefill_holds_its_cores_under_stress() -> None:
    """Two threads hammer the protocol: the prefill side widens and narrows as a lane does between layers,
    the decode side runs steps; a decode step that got its cores back never overlaps a widened prefill."""
    loan = CoreLoan(widen_after_s=0.0, return_timeout_s=10.0)
    state = {"wide": False, "decoding": False}
    errors: list[str] = []
    stop = threading.Event()

    def prefill() -> None:
        while not stop.is_set():
            if loan.lent and loan.wanted_back():
                state["wide"] = False  # narrow first, then say so
                loan.give_back()
            elif not loan.lent and loan.try_borrow():
                state["wide"] = True
                time.sleep(0)  # let the decode thread run here, as it would on a real core
                if state["decoding"]:
                    errors.append("borrowed while a decode step ran")
        state["wide"] = False
        loan.give_back()

    def decode() -> None:
        for _ in range(400):
            with loan.decode_step() as returned:
                state["decoding"] = True
                time.sleep(0)  # a step takes time: the prefill thread gets the interpreter meanwhile
                if returned and state["wide"]:
                    errors.append("decode ran beside a widened prefill")
                state["decoding"] = False

    threads = [threading.Thread(target=prefill), threading.Thread(target=decode)]
    for t in threads:
        t.start()
    threads[1].join(60)
    stop.set()
    threads[0].join(10)
    assert not errors and loan.late_returns == 0
    assert loan.borrows > 0, "the prefill side never got the cores: the test exercised nothing"


def _view() -> tuple[tuple[int, ...], int]:
    """The cores the calling lane thread's products run on (its OpenMP team's masks, one core each; its own mask
    without the CPU library) and its intra-op threads."""
    threads = torch.get_num_threads()
    masks = team_masks(threads) or [os.sched_getaffinity(threading.get_native_id())]
    return tuple(sorted(set().union(*masks))), threads


@pytest.fixture
def cpu() -> CpuCoresBackend:
    """A two-core backend whose loan widens as soon as decode has ended and waits long for a return."""
    backend = CpuCoresBackend()
    if backend.loan is None or len(backend.cores) < 2:
        backend.close()
        pytest.skip("needs two cores")
    backend.loan = CoreLoan(widen_after_s=0.0, return_timeout_s=10.0)
    yield backend
    backend.close()


def test_a_shared_rung_prefill_step_gives_decode_its_core_at_the_next_layer_and_takes_it_back_after(
    cpu: CpuCoresBackend,
) -> None:
    top = cpu.ladder[-1].index
    decode_cores = cpu.cores_for(Lane.DECODE, cpu.ladder[0])
    own = tuple(c for c in cpu.cores if c not in decode_cores)
    layer0, decode_sent, decode_done = threading.Event(), threading.Event(), threading.Event()
    views: dict[str, tuple[tuple[int, ...], int] | None] = {}
    times: dict[str, float] = {}

    def chunk(binding):
        with cpu.step_scope(binding, 256):
            views["layer0"] = _view()
            layer0.set()
            decode_sent.wait(10)
            time.sleep(0.1)  # decode is waiting for its core by now
            times["narrowing"] = time.monotonic()
            between_layers()
            views["layer1"] = _view()
            decode_done.wait(10)
            between_layers()
            views["layer2"] = _view()
        return _view()

    def decode_step(binding):
        with cpu.step_scope(binding, 1):
            times["decode"] = time.monotonic()
            views["prefill beside decode"] = cpu._prefill_view
            views["decode"] = _view()
        decode_done.set()

    with LaneWorker(cpu, Lane.PREFILL, rung=top) as pre, LaneWorker(cpu, Lane.DECODE, rung=0) as dec:
        # the decode lane binds its partition first, as the executor's lanes do before serving
        dec.submit(lambda b: None).result(10)
        running = pre.submit(chunk)
        assert layer0.wait(10)
        stepped = dec.submit(decode_step)
        decode_sent.set()
        stepped.result(10)
        after = running.result(10)
    assert times["decode"] > times["narrowing"], "decode ran before the prefill gave its core back"
    assert views["prefill beside decode"] == (own, len(own)), "decode ran beside a prefill on its core"
    assert views["layer0"] == (cpu.cores, len(cpu.cores)), "an idle decode lends its cores"
    assert views["layer1"] == (own, len(own)), "narrowed to its own cores at the next layer"
    assert views["decode"][0] == decode_cores
    assert views["layer2"] == (cpu.cores, len(cpu.cores)), "widened again once decode went idle"
    assert after == (own, len(own)), "between steps the lane thread waits on its own cores, where its next step starts"
    assert not cpu.loan.lent and cpu.loan.borrows == 2


def test_a_held_prefill_step_runs_on_every_core_through_its_layers_while_decode_waits(cpu: CpuCoresBackend) -> None:
    top = cpu.ladder[-1].index
    cpu.loan = CoreLoan(widen_after_s=10.0, return_timeout_s=0.05, hold_timeout_s=10.0)  # decode counts as busy
    started, decode_sent = threading.Event(), threading.Event()
    views: dict[str, tuple[tuple[int, ...], int]] = {}
    times: dict[str, float] = {}

    def resume(binding):
        with cpu.step_scope(binding, 56, hold_cores=True):
            views["layer0"] = _view()
            started.set()
            decode_sent.wait(10)
            time.sleep(0.1)  # decode is waiting for its core by now
            between_layers()
            views["layer1"] = _view()
            times["end"] = time.monotonic()

    def plain(binding):
        with cpu.step_scope(binding, 56):
            views["plain"] = _view()

    def decode_step(binding):
        with cpu.step_scope(binding, 1):
            times["decode"] = time.monotonic()

    with LaneWorker(cpu, Lane.PREFILL, rung=top) as pre, LaneWorker(cpu, Lane.DECODE, rung=0) as dec:
        dec.submit(lambda b: None).result(10)
        dec.submit(decode_step).result(10)  # decode ran just now: a plain borrow waits widen_after_s
        pre.submit(plain).result(10)
        running = pre.submit(resume)
        assert started.wait(10)
        stepped = dec.submit(decode_step)
        decode_sent.set()
        stepped.result(10)
        running.result(10)
    own = tuple(c for c in cpu.cores if c not in cpu.cores_for(Lane.DECODE, cpu.ladder[0]))
    assert views["plain"] == (own, len(own)), "premise: decode busy, a plain step keeps to its own cores"
    assert views["layer0"] == views["layer1"] == (cpu.cores, len(cpu.cores)), "held: wide through its layers"
    assert times["decode"] > times["end"], "decode ran inside the held step"
    assert cpu.loan.holds == 1 and cpu.loan.late_returns == 0 and not cpu.loan.lent


def test_a_prefill_step_planned_with_nothing_decoding_runs_wide_from_its_start(cpu: CpuCoresBackend) -> None:
    """Right after a decode step a plain prefill step starts on its own cores (decode may be mid-burst); one the
    scheduler planned with nothing decoding (``decode_idle``) starts on every core and stays there between layers."""
    cpu.loan = CoreLoan(widen_after_s=10.0, return_timeout_s=0.05)  # any decode step counts as recent
    top = cpu.ladder[-1].index
    views: dict[str, tuple[tuple[int, ...], int]] = {}

    def chunk(binding, name: str, idle: bool):
        with cpu.step_scope(binding, 256, decode_idle=idle):
            views[f"{name} layer0"] = _view()
            between_layers()
            views[f"{name} layer1"] = _view()

    def decode_step(binding):
        with cpu.step_scope(binding, 1):
            pass

    with LaneWorker(cpu, Lane.PREFILL, rung=top) as pre, LaneWorker(cpu, Lane.DECODE, rung=0) as dec:
        dec.submit(lambda b: None).result(10)
        dec.submit(decode_step).result(10)
        pre.submit(lambda b: chunk(b, "plain", False)).result(10)
        pre.submit(lambda b: chunk(b, "idle", True)).result(10)
    own = tuple(c for c in cpu.cores if c not in cpu.cores_for(Lane.DECODE, cpu.ladder[0]))
    assert views["plain layer0"] == views["plain layer1"] == (own, len(own)), "premise: decode ran just now"
    assert views["idle layer0"] == views["idle layer1"] == (cpu.cores, len(cpu.cores))
    assert not cpu.loan.lent and cpu.loan.borrows == 1


def test_a_preempting_step_inside_a_borrowing_chunk_gives_the_core_back_between_its_own_layers(
    cpu: CpuCoresBackend,
) -> None:
    top = cpu.ladder[-1].index
    own = tuple(c for c in cpu.cores if c not in cpu.cores_for(Lane.DECODE, cpu.ladder[0]))
    inner_started, decode_sent, chunk_started = threading.Event(), threading.Event(), threading.Event()
    log: list[tuple[str, tuple[tuple[int, ...], int]]] = []

    def chunk(binding):
        with cpu.step_scope(binding, 256):
            chunk_started.set()
            for _ in range(200):  # until the resume is queued, as a chunk's layers would
                between_layers()
                if log:
                    break
                time.sleep(0.005)
        return "chunk"

    def resume(binding):
        with cpu.step_scope(binding, 64):
            log.append(("resume0", _view()))
            inner_started.set()
            decode_sent.wait(10)
            time.sleep(0.1)
            log.append(("boundary", _view()))
            between_layers()
            log.append(("resume1", _view()))
        return "resume"

    def decode_step(binding):
        with cpu.step_scope(binding, 1):
            log.append(("decode", _view()))

    with LaneWorker(cpu, Lane.PREFILL, rung=top) as pre, LaneWorker(cpu, Lane.DECODE, rung=0) as dec:
        dec.submit(lambda b: None).result(10)
        outer = pre.submit(chunk)
        assert chunk_started.wait(10)
        inner = pre.submit(resume, preempt=True)
        assert inner_started.wait(10)
        stepped = dec.submit(decode_step)
        decode_sent.set()
        assert [outer.result(10), inner.result(10), stepped.result(10)] == ["chunk", "resume", None]
    names, views = [name for name, _ in log], dict(log)
    # the decode step waits for the resume's layer boundary; past it, the two threads race to the log
    assert names[:2] == ["resume0", "boundary"] and sorted(names[2:]) == ["decode", "resume1"]
    assert views["resume0"] == views["boundary"] == (cpu.cores, len(cpu.cores)), "wide until its layer boundary"
    assert views["resume1"] == (own, len(own)), "narrowed at the boundary"


def test_decode_moving_onto_cores_a_running_prefill_holds_waits_for_its_refit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four (mocked) cores: decode moves up a rung onto a core the running prefill step narrowed to; its next step
    waits until the prefill step's next layer boundary instead of sharing that core."""
    from contextlib import ExitStack

    pinned: dict[int, tuple[int, ...]] = {}
    real_mask, real_setaffinity = os.sched_getaffinity(0), os.sched_setaffinity
    monkeypatch.setattr(os, "sched_getaffinity", lambda tid: {0, 1, 2, 3})
    monkeypatch.setattr(os, "sched_setaffinity", lambda tid, cores: pinned.__setitem__(tid, tuple(sorted(cores))))
    cpu = CpuCoresBackend(cores=[0, 1, 2, 3])
    cpu.loan = CoreLoan(widen_after_s=10.0, return_timeout_s=10.0)  # decode stays "recent": the prefill stays narrow
    small, bigger = [r for r in cpu.ladder if r.partitioned][:2]
    assert small.decode_units < bigger.decode_units
    entered = threading.Event()

    def decode_on(rung, then: threading.Event | None = None) -> None:
        with ExitStack() as stack:
            binding = stack.enter_context(cpu._bind(Lane.DECODE, rung))
            with cpu.step_scope(binding, 1):
                if then is not None:
                    then.set()

    with ExitStack() as stack:
        # the team's pins are real (the C side's) and the mocked restores are not: give this thread its mask back
        stack.callback(real_setaffinity, 0, real_mask)
        stack.callback(release_team)
        prefill = stack.enter_context(cpu._bind(Lane.PREFILL, cpu.ladder[-1]))
        decode_on(small)  # decode's home: the small rung's cores
        with cpu.step_scope(prefill, 256):
            first_view = cpu._prefill_view
            assert first_view is not None and set(first_view[0]) & set(cpu.cores[: bigger.decode_units])
            t = threading.Thread(target=decode_on, args=(bigger, entered))
            t.start()
            assert not entered.wait(0.2), "decode ran on a core the prefill step still held"
            cpu.between_layers(prefill)
            assert entered.wait(10)
            t.join(10)
            narrowed = cpu._prefill_view
    assert first_view is not None and narrowed is not None
    assert not set(narrowed[0]) & set(cpu.cores[: bigger.decode_units]), "the refit leaves decode's new cores"
    assert cpu.loan.late_returns == 0


def test_a_prefill_step_that_fails_returns_the_cores_and_the_lane_its_binding(cpu: CpuCoresBackend) -> None:
    top = cpu.ladder[-1].index

    def failing(binding):
        with cpu.step_scope(binding, 256):
            assert cpu.loan.lent, "decode idle: the step borrowed its cores"
            raise RuntimeError("the step failed mid-way")

    with LaneWorker(cpu, Lane.PREFILL, rung=top) as pre:
        with pytest.raises(RuntimeError, match="mid-way"):
            pre.submit(failing).result(10)
        own = tuple(c for c in cpu.cores if c not in cpu.cores_for(Lane.DECODE, cpu.ladder[0]))
        assert pre.submit(lambda b: _view()).result(10) == (own, len(own))
    assert not cpu.loan.lent and cpu._prefill_view is None


def test_closing_the_backend_logs_the_loans_tally(cpu: CpuCoresBackend, caplog: pytest.LogCaptureFixture) -> None:
    assert cpu.loan.try_borrow()
    cpu.loan.give_back()
    with caplog.at_level("INFO", logger="agentserve.executor.partition.cpu_cores"):
        cpu.close()
    assert "borrowed decode's cores 1 times (0 held to a step's end); 0 decode steps waited for them (0.0 ms on " \
        "average), 0 ran before" \
        in caplog.text
