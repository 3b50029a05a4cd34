"""Ring behaviour inside one process: framing, wrap-around, backpressure, close, corrupted slots."""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import time

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from shm_helpers import SESSION, ours

from agentserve.protocol.lanes import Lane, Rung
from agentserve.protocol.ring_messages import (
    DecodeError,
    ExecError,
    Plan,
    Ready,
    Reconfigure,
    Release,
    Result,
    SeqPlan,
    SeqResult,
    Shutdown,
    to_executor_codec,
)
from agentserve.protocol.sampling import SamplingParams
from agentserve.shm.channel import RingPair
from agentserve.shm.errors import CorruptFrame, MessageTooLarge, RingClosed, RingTimeout
from agentserve.shm.ring import RingReader, RingWriter


@contextlib.contextmanager
def ring(run: str, slots: int = 4, slot_size: int = 256, codec=None):
    w = RingWriter.create(run, "r", slots, slot_size, codec)
    r = RingReader.attach(run, "r", codec)
    try:
        yield w, r
    finally:
        r.close()
        w.close()


def plan(step: int, n: int = 3) -> Plan:
    seqs = [SeqPlan(i, [i, i + 1], 7 * i, [100 + i], sampling=SamplingParams(seed=i)) for i in range(n)]
    return Plan(step, Lane.DECODE, 2, 128, seqs)


def test_bytes_round_trip_across_many_wraps(run):
    with ring(run, slots=3, slot_size=64) as (w, r):
        for i in range(50):
            w.put(bytes([i % 256]) * (i % 65))
            assert r.get_bytes(timeout=1) == bytes([i % 256]) * (i % 65)


def test_accepts_bytearray_and_memoryview(run):
    with ring(run) as (w, r):
        w.put(bytearray(b"abc"))
        w.put(memoryview(b"xyz12345").cast("I"))  # non-byte format: sent as its bytes
        assert r.get_bytes(timeout=1) == b"abc"
        assert r.get_bytes(timeout=1) == b"xyz12345"


def test_every_wire_message_round_trips_through_a_pair(run):
    to_exec = [plan(1), Release([1, 2]), Reconfigure(decode_rung=3), Shutdown("bye")]
    from_exec = [
        Ready(1, 42, 100, 16, 4096, 32000, [2], "cpu", "no gpu", [Rung(0, 4, 4, False)], "cpu", "m"),
        Result(1, Lane.PREFILL, 0, [SeqResult(1, 5, -0.25)], 1.0, 2.0, 0.5),
        ExecError("boom", 3, [1], True),
    ]
    with RingPair.create(run, slots=4, slot_size=4096) as orch, RingPair.attach(run) as exe:
        for msg in to_exec:
            orch.send(msg, timeout=1)
            assert exe.recv(timeout=1) == msg
        for msg in from_exec:
            exe.send(msg, timeout=1)
            assert orch.recv(timeout=1) == msg
        assert orch.peer_pid == exe.pid and exe.peer_pid == orch.pid


def test_message_larger_than_a_slot_is_rejected_naming_both_sizes(run):
    with ring(run, slot_size=100, codec=to_executor_codec()) as (w, r):
        with pytest.raises(MessageTooLarge, match=r"101 bytes .* 100 bytes"):
            w.put(b"x" * 101)
        big = plan(1, n=40)
        size = len(to_executor_codec().encode(big))
        with pytest.raises(MessageTooLarge, match=rf"{size} bytes .* 100 bytes"):
            w.put(big)
        w.put(b"x" * 100)  # nothing was half-sent: the ring still works, in order
        assert r.get_bytes(timeout=1) == b"x" * 100
        assert not r.poll()


def test_full_ring_applies_backpressure_then_times_out(run):
    with ring(run, slots=4) as (w, r):
        for i in range(4):
            w.put(bytes([i]))
        with pytest.raises(RingTimeout, match="stayed full"):
            w.put(b"late", timeout=0.2)
        with pytest.raises(RingTimeout):
            w.put(b"late", timeout=0)
        assert r.get_bytes(timeout=1) == b"\x00"
        w.put(b"\x04", timeout=0)
        assert [r.get_bytes(timeout=1) for _ in range(4)] == [b"\x01", b"\x02", b"\x03", b"\x04"]


def test_empty_ring_times_out(run):
    with ring(run) as (_w, r), pytest.raises(RingTimeout, match="no message"):
        r.get_bytes(timeout=0.15)


def test_blocked_writer_resumes_when_the_reader_frees_a_slot(run):
    with ring(run, slots=2) as (w, r):
        done = threading.Event()

        def produce():
            for i in range(20):
                w.put(bytes([i]), timeout=10)
            done.set()

        t = threading.Thread(target=produce)
        t.start()
        got = []
        for _ in range(20):
            time.sleep(0.005)  # make the writer park on the full ring
            got.append(r.get_bytes(timeout=10)[0])
        t.join(10)
        assert done.is_set() and got == list(range(20))


def test_parked_writer_takes_a_single_freed_slot_without_waiting_for_more(run):
    with ring(run, slots=8) as (w, r):
        for i in range(8):
            w.put(bytes([i]))
        t = threading.Thread(target=lambda: w.put(b"\x08", timeout=10))
        t.start()
        time.sleep(0.3)  # the writer parks on the slot a quarter ahead
        assert r.get_bytes(timeout=1) == b"\x00"  # free one slot only, then stop reading
        t.join(5)
        assert not t.is_alive()
        assert [r.get_bytes(timeout=1)[0] for _ in range(8)] == list(range(1, 9))


def _blocked_get(r: RingReader, errors: list) -> threading.Thread:
    def wait():
        try:
            r.get_bytes(timeout=30)
        except Exception as e:  # noqa: BLE001 — the type is the assertion
            errors.append(e)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.3)  # past the spin: parked on the semaphore
    return t


def test_shutdown_wakes_a_waiting_reader_with_ring_closed(run):
    with ring(run) as (_w, r):
        errors: list = []
        t = _blocked_get(r, errors)
        r.shutdown()
        t.join(5)
        assert not t.is_alive() and len(errors) == 1 and isinstance(errors[0], RingClosed)


def test_close_from_another_thread_wakes_the_waiter_then_unmaps(run):
    w = RingWriter.create(run, "r", 4, 64)
    r = RingReader.attach(run, "r")
    errors: list = []
    t = _blocked_get(r, errors)
    w.close()  # the owner goes first: names are gone at once
    assert ours(run) == []
    r.close()  # from this thread, while the other one waits in get()
    t.join(5)
    assert not t.is_alive() and len(errors) == 1 and isinstance(errors[0], RingClosed)
    assert r._released and not r.poll() and r.closed
    with pytest.raises(RingClosed):
        r.get_bytes(timeout=0)


def test_writer_close_lets_the_reader_drain_then_raises_ring_closed(run):
    with ring(run) as (w, r):
        w.put(b"last words")
        w.shutdown()
        assert r.get_bytes(timeout=1) == b"last words"
        with pytest.raises(RingClosed):
            r.get_bytes(timeout=1)
        with pytest.raises(RingClosed):
            w.put(b"more")


def test_reader_close_stops_the_writer(run):
    with ring(run) as (w, r):
        r.shutdown()
        with pytest.raises(RingClosed):
            w.put(b"x", timeout=1)


def test_create_refuses_an_existing_ring(run):
    from agentserve.shm.errors import SegmentError

    with ring(run), pytest.raises(SegmentError, match="already exists"):
        RingWriter.create(run, "r")


# ------------------------------------------------------------------ corrupted slots

SLOT = 320  # first slot's offset (see ring.py layout)
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _outcome(r: RingReader):
    """Decode one slot; return the message or the typed error. Any other exception fails the test."""
    try:
        return r.get(timeout=0)
    except (DecodeError, RingTimeout) as e:
        return e


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(0, 7 + 200), st.integers(0, 255)), min_size=1, max_size=8))
def test_corrupted_frame_or_payload_gives_a_typed_error(run, edits):
    codec = to_executor_codec()
    with ring(run, slots=2, slot_size=1024, codec=codec) as (w, r):
        w.put(plan(5))
        for pos, value in edits:  # flag, reserved, length and payload bytes
            w._buf[SLOT + pos] = value
        got = _outcome(r)
        flag = w._buf[SLOT]
        assert isinstance(got, msgspec.Struct | DecodeError | RingTimeout)
        if isinstance(got, RingTimeout):
            assert flag == 0  # only an EMPTY flag looks like "nothing there"
        if flag not in (0, 1):
            assert isinstance(got, CorruptFrame)


@FUZZ
@given(payload=st.binary(max_size=300), claimed=st.one_of(st.none(), st.integers(0, 2**32 - 1)))
def test_random_payload_and_length_decode_or_raise_decode_error(run, payload, claimed):
    codec = to_executor_codec()
    with ring(run, slots=2, slot_size=512, codec=codec) as (w, r):
        w.put(payload)
        if claimed is not None:
            w._lens[(SLOT >> 2) + 1] = claimed
        got = _outcome(r)
        assert isinstance(got, msgspec.Struct | DecodeError)
        if claimed is not None and claimed > 512:
            assert isinstance(got, CorruptFrame)
        w.put(plan(1))  # the bad slot was consumed: the ring goes on
        assert r.get(timeout=1) == plan(1)


# ------------------------------------------------------------------ model-based (hypothesis state machine)


class RingModel(RuleBasedStateMachine):
    """Random puts / gets / oversize puts against a deque: same contents, same order, same errors."""

    SLOTS, SLOT_SIZE = 5, 48

    def __init__(self) -> None:
        super().__init__()
        self.run = f"{SESSION}sm{next(_machines)}"
        self.w = RingWriter.create(self.run, "r", self.SLOTS, self.SLOT_SIZE)
        self.r = RingReader.attach(self.run, "r")
        self.model: collections.deque[bytes] = collections.deque()

    @rule(data=st.binary(max_size=SLOT_SIZE))
    def put(self, data):
        if len(self.model) == self.SLOTS:
            with pytest.raises(RingTimeout):
                self.w.put(data, timeout=0)
        else:
            self.w.put(data, timeout=0)
            self.model.append(data)

    @rule(extra=st.integers(1, 100))
    def put_too_large(self, extra):
        with pytest.raises(MessageTooLarge):
            self.w.put(b"z" * (self.SLOT_SIZE + extra), timeout=0)

    @rule()
    def get(self):
        if not self.model:
            with pytest.raises(RingTimeout):
                self.r.get_bytes(timeout=0)
        else:
            assert self.r.get_bytes(timeout=0) == self.model.popleft()

    @invariant()
    def poll_matches(self):
        assert self.r.poll() == bool(self.model)

    def teardown(self):
        self.r.close()
        self.w.close()


_machines = itertools.count()
TestRingModel = RingModel.TestCase
TestRingModel.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
