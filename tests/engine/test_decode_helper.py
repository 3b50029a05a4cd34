"""The decode helper (``executor/fused/helper.c``): a second thread sharing the fused decode step's chunks without a
barrier.  Whatever the helper does — takes chunks, stalls inside them so that the lane thread takes them back, is
disallowed, is handed a batch too large for it — the step's logits are bitwise those of the step without it."""

from __future__ import annotations

import gc
import os
import random
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from engine_helpers import GreedyDriver, fused_runs_here, random_bf16_qwen2

from agentserve.executor.errors import EngineError
from agentserve.executor.partition.omp_team import release_team
from agentserve.executor.runner import DecodeItem, ModelRunner

TWO_CPUS = len(os.sched_getaffinity(0)) > 1  # else the helper shares the lane thread's CPU and may never run

pytestmark = pytest.mark.skipif(not fused_runs_here(), reason="no FBGEMM, C compiler or AVX2+FMA+F16C here")


@pytest.fixture(scope="module")
def wide_path(tmp_path_factory):
    """A Qwen2 of the ``bench`` model's width (hidden 512, 8 heads of 64, 2 KV heads, intermediate 1408) and 3
    layers: its chunks take microseconds, so a chunk the helper copies after the lane thread took it back would land
    in the middle of the step's later work."""
    return random_bf16_qwen2(tmp_path_factory.mktemp("helper_wide") / "qwen2_wide", 5, 0.05, hidden_size=512,
                             num_attention_heads=8, num_key_value_heads=2, intermediate_size=1408,
                             num_hidden_layers=3)


def _runner(path, **kwargs) -> ModelRunner:
    runner = ModelRunner(path, device="cpu", dtype="float32", num_blocks=96, weights="fp16", **kwargs)
    assert runner.fused_decode is not None
    return runner


def _prefilled(runner: ModelRunner, prompts: list[list[int]], seqs: int) -> tuple[GreedyDriver, list[int]]:
    driver = GreedyDriver(runner, seqs)
    first = driver.prefill(list(range(seqs)), [prompts[s % len(prompts)] + [3] * s for s in range(seqs)])
    release_team()  # as the executor does: an idle OpenMP worker spinning on the helper's core would starve it
    return driver, first.argmax(-1).tolist()


@pytest.fixture
def helper_of():
    """Starts helpers on the process's other CPUs (or its only one) and closes them after the test.  At normal
    priority: at ``SCHED_IDLE`` (the default, tested below) any other load on those CPUs, a test run beside this one,
    would keep it from taking the chunks these tests count."""
    made = []

    def start(runner: ModelRunner, max_batch: int | None = None, idle: bool = False):
        helper = runner.fused_decode.helper() if max_batch is None else runner.fused_decode.helper(max_batch)
        cores = sorted(os.sched_getaffinity(0))
        helper.start(cores[1:] or cores, idle=idle)
        made.append(helper)
        return helper

    yield start
    for helper in made:
        helper.close()


@contextmanager
def lane_thread() -> Iterator[None]:
    """The calling thread as a decode lane's: one intra-op thread, on the first CPU only (the helper is on the
    others; at SCHED_IDLE it would not run beside this thread on one CPU)."""
    tid, before = threading.get_native_id(), torch.get_num_threads()
    mask = os.sched_getaffinity(tid)
    torch.set_num_threads(1)
    os.sched_setaffinity(tid, sorted(mask)[:1])
    try:
        yield
    finally:
        os.sched_setaffinity(tid, mask)
        torch.set_num_threads(before)


@pytest.mark.parametrize("case_name", ["llama_tied", "qwen3_headdim", "qwen2_tied_bias"])
def test_a_shared_step_computes_bitwise_what_the_lane_thread_computes_alone(case_name, bf16_paths, cases,
                                                                            helper_of):
    """Batches of 1-5 sequences over caches of different lengths, the same steps with and without the helper
    (each rewrites the same slots with the same K/V), then again with the helper stalling in every third chunk it
    takes: the lane thread takes those back, and runs a step alone while the helper is still in the step before
    the previous one."""
    runner = _runner(bf16_paths[case_name])
    driver, first = _prefilled(runner, cases[case_name].prompts, 5)
    helper = helper_of(runner)
    with lane_thread():
        for stall in (0, 3):
            helper.stall(stall, 300)
            for n in (1, 2, 3, 5):
                items = [DecodeItem(first[s], driver.cached[s], driver.tables[s]) for s in range(n)]
                alone = runner.decode(items)
                for _ in range(3):
                    assert torch.equal(runner.decode(items, helper=helper), alone)
    # steps of these small models take tens of µs: whether the helper wakes in time for their chunks, and how often a
    # stalled helper makes a step run without it, varies; the stress test below counts on a wider model
    assert helper.counts()["steps"] > 0


def test_random_batches_and_stalls_over_many_steps(wide_path, cases, helper_of):
    """A stress run: greedy decoding of random subsets of six sequences for 150 steps, the helper's stalls
    changing every step (none, a few chunks' time, longer than a step) and now and then disallowed, against the
    same decoding without the helper."""
    runners = [_runner(wide_path) for _ in range(2)]
    drivers = [_prefilled(r, cases["qwen2_tied_bias"].prompts, 6) for r in runners]
    helper = helper_of(runners[1])
    rng = random.Random(7)
    last = [list(drivers[0][1]), list(drivers[1][1])]
    with lane_thread():
        for step in range(150):
            seqs = sorted(rng.sample(range(6), rng.randint(1, 6)))
            helper.stall(rng.choice([0, 1, 2, 5]), rng.choice([8, 30, 200, 3000]))
            helper.allow(rng.random() > 0.1)
            out = []
            for i, (driver, _) in enumerate(drivers):
                items = [DecodeItem(last[i][s], driver.cached[s], driver.tables[s]) for s in seqs]
                for s in seqs:
                    driver.cached[s] += 1
                out.append(runners[i].decode(items, helper=helper if i else None))
            assert torch.equal(out[0], out[1]), f"step {step}: {seqs}"
            for i in (0, 1):
                for s, t in zip(seqs, out[i].argmax(-1).tolist(), strict=True):
                    last[i][s] = t
    counts = helper.counts()
    assert 0 < counts["steps"] < 150
    assert (counts["helped"] > 0 and counts["taken_back"] > 0) or not TWO_CPUS


def test_the_helper_shares_nothing_it_cannot_take(bf16_paths, cases, helper_of):
    """A batch beyond its ``max_batch``, a step on two threads, a disallowed helper: those steps run without it."""
    runner = _runner(bf16_paths["llama_tied"])
    driver, first = _prefilled(runner, cases["llama_tied"].prompts, 3)
    helper = helper_of(runner, max_batch=2)
    items = [DecodeItem(first[s], driver.cached[s], driver.tables[s]) for s in range(3)]
    alone = runner.decode(items)
    with lane_thread():
        assert torch.equal(runner.decode(items, helper=helper), alone)  # 3 > max_batch
        helper.allow(False)
        assert torch.equal(runner.decode(items[:2], helper=helper), runner.decode(items[:2]))
        assert helper.counts()["steps"] == 0
        helper.allow(True)
        torch.set_num_threads(2)
        runner.decode(items[:2], helper=helper)
        assert helper.counts()["steps"] == 0
        torch.set_num_threads(1)
        runner.decode(items[:2], helper=helper)
        assert helper.counts()["steps"] == 1


def test_a_helper_keeps_its_step_until_closed(bf16_paths):
    """A helper still inside a chunk of a step its lane thread has left reads that job's model, weights and cache
    until it sees the job is stale: its owner may drop the runner first (a test's fixture closing helpers after the
    test did, and the helper divided by a freed model's head count), so the helper holds the fused step."""
    runner = _runner(bf16_paths["llama_tied"])
    step = weakref.ref(runner.fused_decode)
    helper = runner.fused_decode.helper()
    del runner
    gc.collect()
    assert step() is not None
    helper.close()
    gc.collect()
    assert step() is None


def test_decode_helper_setting(bf16_paths, cases):
    with pytest.raises(EngineError, match="decode_helper"):
        _runner(bf16_paths["llama_tied"], decode_helper="on")
    assert _runner(bf16_paths["llama_tied"], decode_helper="off").new_decode_helper() is None
    helper = _runner(bf16_paths["llama_tied"]).new_decode_helper()
    assert helper is not None
    helper.close()  # never started: closing frees it
    assert ModelRunner(cases["llama_tied"].path, device="cpu", num_blocks=8).new_decode_helper() is None  # no fused


def test_by_default_the_helper_runs_at_idle_priority(bf16_paths, helper_of):
    """It takes only what the orchestrator and the clients leave of its core, and still shares steps bitwise."""
    runner = _runner(bf16_paths["llama_tied"])
    helper = helper_of(runner, idle=True)
    assert helper.idle
    policy = {t.native_id: t for t in threading.enumerate()}[helper._thread.native_id]
    assert os.sched_getscheduler(policy.native_id) == os.SCHED_IDLE
