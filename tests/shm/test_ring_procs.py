"""Two processes over a ring: a million messages in order, and a peer killed with SIGKILL."""

from __future__ import annotations

import collections
import multiprocessing as mp
import os
import random
import signal
import time

import pytest

from agentserve.protocol.lanes import Lane
from agentserve.protocol.ring_messages import Plan, Result, SeqPlan, SeqResult, Shutdown
from agentserve.shm.channel import RingPair
from agentserve.shm.errors import PeerDied, RingTimeout
from agentserve.shm.ring import RingReader, RingWriter

FORK = mp.get_context("fork")
SLOTS, SLOT_SIZE = 64, 4096
N_MESSAGES = 1_000_000
POOL = random.Random(7).randbytes(2 * SLOT_SIZE)
SIZES = [random.Random(11).randint(16, SLOT_SIZE) for _ in range(4099)]  # 4099: prime, not a power of 2


def message(i: int) -> bytes:
    """Message ``i``: its number at both ends, pool bytes in between, a size from ``SIZES``."""
    seq = i.to_bytes(8, "little")
    k = i & 4095
    return seq + POOL[k : k + SIZES[i % 4099] - 16] + seq


def write_all(run: str, n: int) -> None:
    w = RingWriter.attach(run, "r")
    put = w.put
    for i in range(n):
        put(message(i), timeout=30)
    w.close()


def check(got: bytes, i: int) -> None:
    """Fail naming what went wrong with message ``i`` (lost, duplicated, reordered or torn)."""
    assert len(got) == SIZES[i % 4099], f"message {i}: length {len(got)} != {SIZES[i % 4099]}"
    first, last = int.from_bytes(got[:8], "little"), int.from_bytes(got[-8:], "little")
    assert first == last == i, f"expected message {i}, got head {first} / tail {last}"
    assert got == message(i), f"message {i}: payload bytes differ"


def test_a_million_messages_arrive_once_and_in_order(run):
    r = RingReader.create(run, "r", SLOTS, SLOT_SIZE)
    p = FORK.Process(target=write_all, args=(run, N_MESSAGES))
    p.start()
    try:
        r.expect_peer(p.pid)
        get = r.get_bytes
        for i in range(N_MESSAGES):
            got = get(timeout=30)
            head = got[:8]
            # cheap checks on every message; the full check on 1 in 97 and on any doubt
            if head != i.to_bytes(8, "little") or got[-8:] != head or len(got) != SIZES[i % 4099] or not i % 97:
                check(got, i)
        assert not r.poll(), "more messages than were sent"
        p.join(30)
        assert p.exitcode == 0
    finally:
        if p.is_alive():
            p.kill()
        p.join()
        r.close()
    assert N_MESSAGES // SLOTS > 10_000  # many wrap-arounds


# ------------------------------------------------------------------ peer killed with SIGKILL


def slow_writer(run: str, seed: int) -> None:
    rng = random.Random(seed)
    w = RingWriter.attach(run, "r")
    i = 0
    while True:
        w.put(message(i), timeout=30)
        i += 1
        if rng.random() < 0.05:
            time.sleep(rng.random() * 0.03)


def slow_reader(run: str, seed: int) -> None:
    rng = random.Random(seed)
    r = RingReader.attach(run, "r")
    while True:
        r.get_bytes(timeout=30)
        time.sleep(rng.random() * 0.003)


def kill_at_random(p, rng: random.Random) -> float:
    time.sleep(rng.random() * 0.3)
    os.kill(p.pid, signal.SIGKILL)  # not reaped: the survivor must see through the zombie
    return time.monotonic()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_reader_on_empty_ring_raises_peer_died_when_the_writer_is_killed(run, seed):
    rng = random.Random(seed)
    r = RingReader.create(run, "r", SLOTS, SLOT_SIZE)
    p = FORK.Process(target=slow_writer, args=(run, seed))
    p.start()
    try:
        while not r.poll():
            time.sleep(0.001)
        r.get_bytes(timeout=5)
        killed = kill_at_random(p, rng)
        with pytest.raises(PeerDied) as info:
            i = 1
            while True:
                check(r.get_bytes(timeout=1.0), i)  # drains what was sent; RingTimeout = not detected
                i += 1
        assert info.value.pid == p.pid and info.value.role == "writer"
        print(f"PeerDied {time.monotonic() - killed:.3f} s after SIGKILL")
    finally:
        p.kill()
        p.join()
        r.close()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_writer_on_full_ring_raises_peer_died_when_the_reader_is_killed(run, seed):
    rng = random.Random(seed)
    w = RingWriter.create(run, "r", 8, 256)
    p = FORK.Process(target=slow_reader, args=(run, seed))
    p.start()
    try:
        w.expect_peer(p.pid)
        killed = kill_at_random(p, rng)
        with pytest.raises(PeerDied) as info:
            while True:
                w.put(b"x" * 200, timeout=1.0)  # RingTimeout here = death not detected in 1 s
        assert info.value.pid == p.pid and info.value.role == "reader"
        print(f"PeerDied {time.monotonic() - killed:.3f} s after SIGKILL")
    finally:
        p.kill()
        p.join()
        w.close()


def test_peer_that_dies_before_attaching_is_caught_through_expect_peer(run):
    r = RingReader.create(run, "r", 4, 64)
    p = FORK.Process(target=time.sleep, args=(30,))
    p.start()
    try:
        r.expect_peer(p.pid)
        with pytest.raises(RingTimeout):
            r.get_bytes(timeout=0.2)  # alive but silent: just a timeout
        p.kill()
        with pytest.raises(PeerDied):
            r.get_bytes(timeout=1.0)
    finally:
        p.kill()
        p.join()
        r.close()


# ------------------------------------------------------------------ wire messages between two processes


def echo_executor(run: str) -> None:
    """An executor stand-in: answers every Plan with a Result naming its sequences, until Shutdown."""
    pair = RingPair.attach(run)
    try:
        while not isinstance(msg := pair.recv(timeout=30), Shutdown):
            rows = [SeqResult(s.seq_id, sum(s.token_ids) + s.start_pos) for s in msg.seqs]
            pair.send(Result(msg.step, msg.lane, msg.rung, rows, 0.0, 1.0), timeout=30)
    finally:
        pair.close()


def random_plan(rng: random.Random, step: int) -> Plan:
    seqs = [
        SeqPlan(rng.randrange(2**40), [rng.randrange(200_000) for _ in range(rng.randrange(1, 40))],
                rng.randrange(100_000), [rng.randrange(10**6) for _ in range(rng.randrange(3))])
        for _ in range(rng.randrange(1, 65))
    ]
    return Plan(step, Lane(step % 2), rng.randrange(4), rng.randrange(1, 8192), seqs)


def test_plans_and_results_cross_processes_through_a_ring_pair(run):
    rng = random.Random(5)
    orch = RingPair.create(run, slots=16, slot_size=16 * 1024)
    p = FORK.Process(target=echo_executor, args=(run,))
    p.start()
    try:
        orch.expect_peer(p.pid)
        sent: collections.deque[Plan] = collections.deque()
        for step in range(3000):
            sent.append(random_plan(rng, step))
            orch.send(sent[-1], timeout=30)
            while len(sent) > 8 or (step == 2999 and sent):  # keep up to 8 plans in flight
                plan, res = sent.popleft(), orch.recv(timeout=30)
                assert (res.step, res.lane, res.rung) == (plan.step, plan.lane, plan.rung)
                assert res.seqs == [SeqResult(s.seq_id, sum(s.token_ids) + s.start_pos) for s in plan.seqs]
        orch.send(Shutdown("done"), timeout=30)
        p.join(30)
        assert p.exitcode == 0 and orch.peer_pid == p.pid
    finally:
        p.kill()
        p.join()
        orch.close()
