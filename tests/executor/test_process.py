"""The executor process end to end over real rings: Ready, plans on both lanes, results, shutdown, peer death."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from agentserve.executor.builtin import resolve_model
from agentserve.protocol.lanes import Lane
from agentserve.protocol.ring_messages import ExecError, Plan, Ready, Release, Result, SeqPlan, Shutdown
from agentserve.protocol.sampling import SamplingParams
from agentserve.shm.channel import RingPair


def _spawn(run: str, model: str, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "agentserve.executor", "--run", run, "--model", model, "--dtype", "float32"]
    return subprocess.Popen([*cmd, "--num-blocks", "64", *extra], stderr=subprocess.PIPE, text=True)


@pytest.fixture()
def executor():
    run = f"t{uuid.uuid4().hex[:8]}"
    pair = RingPair.create(run)
    proc = _spawn(run, str(resolve_model("tiny")))
    pair.expect_peer(proc.pid)
    try:
        yield pair, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        pair.close()


def _prefill(seq: int, prompt: list[int], lane: Lane, step: int, n: int) -> Plan:
    sp = SeqPlan(seq, prompt, 0, new_blocks=[seq * 4 + i for i in range(4)], sampling=SamplingParams(max_tokens=n))
    return Plan(step=step, lane=lane, rung=0, token_budget=len(prompt), seqs=[sp])


def _generate(pair: RingPair, seq: int, prompt: list[int], lane: Lane, n: int) -> list[int]:
    pair.send(_prefill(seq, prompt, lane, 0, n))
    out: list[int] = []
    while True:
        res = pair.recv(timeout=30)
        assert isinstance(res, Result), res
        (r,) = res.seqs
        out.append(r.token_id)
        if r.finish:
            return out
        pair.send(Plan(step=len(out), lane=Lane.DECODE, rung=0, token_budget=1,
                       seqs=[SeqPlan(seq, [], len(prompt) + len(out) - 1)]))


def test_ready_then_generate_on_both_lanes_then_shutdown(executor) -> None:
    pair, proc = executor
    ready = pair.recv(timeout=120)
    assert isinstance(ready, Ready), ready
    assert ready.num_blocks == 64 and ready.backend and ready.ladder and ready.pid == proc.pid
    assert ready.device.startswith("cpu (") and "cpu cpu" not in ready.device, ready.device  # the device named once
    prompt = [11, 12, 13, 14, 15]
    via_decode_lane = _generate(pair, 0, prompt, Lane.DECODE, 6)
    via_prefill_lane = _generate(pair, 1, prompt, Lane.PREFILL, 6)
    assert len(via_decode_lane) == 6 and via_decode_lane == via_prefill_lane
    pair.send(Release([0, 1]))
    # A bad plan gets an error, not a crash: the next one still works.
    pair.send(Plan(step=9, lane=Lane.DECODE, rung=0, token_budget=1, seqs=[SeqPlan(5, [1], 0, new_blocks=[999])]))
    err = pair.recv(timeout=30)
    assert isinstance(err, ExecError) and not err.fatal and err.seq_ids == [5]
    assert _generate(pair, 2, prompt, Lane.DECODE, 6) == via_decode_lane
    pair.send(Shutdown("test done"))
    assert proc.wait(timeout=30) == 0


def test_sigterm_exits_cleanly(executor) -> None:
    pair, proc = executor
    assert isinstance(pair.recv(timeout=120), Ready)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0


def _orchestrator(run: str, model: str, conn) -> None:
    pair = RingPair.create(run)
    proc = _spawn(run, model)
    pair.expect_peer(proc.pid)
    pair.recv(timeout=120)
    conn.send(proc.pid)
    time.sleep(60)


def test_executor_exits_when_orchestrator_dies() -> None:
    run = f"t{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    orch = ctx.Process(target=_orchestrator, args=(run, str(resolve_model("tiny")), child))
    orch.start()
    try:
        assert parent.poll(120), "executor never became ready"
        exec_pid = parent.recv()
        os.kill(orch.pid, signal.SIGKILL)
        orch.join()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 5:
            try:
                os.kill(exec_pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            os.kill(exec_pid, signal.SIGKILL)
            pytest.fail("executor outlived its orchestrator by 5 s")
        # ~0.1 s on an idle machine; the bound only has to tell "exits promptly" from "hangs" on a busy one.
        assert time.monotonic() - t0 < 3.0
        # The dead orchestrator could not remove its rings; the executor that outlived it does, on its way out.
        assert [e for e in os.listdir("/dev/shm") if f"-{run}-" in e] == []
    finally:
        if orch.is_alive():
            orch.kill()
        from agentserve.shm.segment import cleanup_stale

        cleanup_stale()
