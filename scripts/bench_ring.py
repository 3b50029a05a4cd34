"""Shared-memory ring vs ZeroMQ ipc:// PUSH/PULL, carrying the same msgspec bytes.

Messages: a decode ``Plan`` of 64 ``SeqPlan`` rows (~1.2 KB) and a small ``Result`` (4 rows,
~130 B), encoded with the wire codec.  The sender writes its ``perf_counter_ns`` into the
message's ``step`` field (an 8-byte msgpack uint) just before sending, so every message is a valid
one; the receiver, another process, timestamps arrival (CLOCK_MONOTONIC is system-wide).
The ring uses the production geometry (``RingPair`` defaults: 64 slots x 128 KiB).

Per transport and message kind:

* ``p50_us`` / ``p99_us``: paced one-way latency, the sender sleeping ``--gap-us`` between
  messages (~0.15 ms with timer slack), the ring reader with its default (no) spin: it parks and
  is woken through its semaphore.  ``spin2ms_*``: the same with a reader that
  spins 2 ms, as one with a core of its own may (a contended CPU defeats it).
  ``parked_*``: 5 ms between messages.
* ``msgs_per_s``: the sender as fast as it can, first send to last arrival (best of 2 runs).
  The receiver gets the message bytes (``get_bytes`` / ``recv``).
* ``send_cpu_us`` / ``recv_cpu_us``: CPU per message of each process (all its threads, so ZeroMQ's
  I/O thread counts) in that run; ``capacity_msgs_per_s`` = 1e6 / the larger one: the rate with
  a free core per side, which a loaded machine's wall clock hides.
* ``decode_msgs_per_s``: as ``msgs_per_s`` with the receiver decoding each message too (the ring
  straight from the slot) — msgspec decode dominates there, for both.

``idle_cpu_percent``: CPU of a ring reader blocked 3 s on an empty ring (getrusage).
Top-level ratios: ring/zmq p50 latency and ring/zmq ``msgs_per_s``, the worse message kind.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import resource
import tempfile
import time

import zmq

from agentserve.protocol.lanes import Lane
from agentserve.protocol.ring_messages import Plan, Result, SeqPlan, SeqResult, from_executor_codec, to_executor_codec
from agentserve.shm.channel import DEFAULT_SLOT_SIZE, DEFAULT_SLOTS
from agentserve.shm.errors import RingTimeout
from agentserve.shm.ring import DEFAULT_SPIN_S, RingReader, RingWriter

STAMP = 2**62  # placeholder step: always encoded as 0xcf + 8 bytes
WARMUP = 2000
LONG_SPIN_S = 2e-3
CODECS = {"plan": to_executor_codec, "result": from_executor_codec}


def templates() -> dict[str, tuple[bytes, int]]:
    """Encoded messages and the offset of their 8-byte step field."""
    seqs = [SeqPlan(1_000_000 + i, [151_000 + i], 2000 + i, [5000 + i] if i % 16 == 0 else []) for i in range(64)]
    rows = [SeqResult(1_000_000 + i, 150_000 + i, -0.5) for i in range(4)]
    msgs = {"plan": Plan(STAMP, Lane.DECODE, 3, 64, seqs), "result": Result(STAMP, Lane.DECODE, 3, rows, 1.0, 2.0)}
    out = {}
    for kind, msg in msgs.items():
        raw = CODECS[kind]().encode(msg)
        out[kind] = (raw, raw.index(b"\xcf" + STAMP.to_bytes(8, "big")) + 1)
    return out


# ------------------------------------------------------------------ receivers (child processes)


def _receive(recv, n: int, off: int, decoded: bool) -> dict:
    """Take ``n`` messages after the warm-up; the send time is the step field."""
    for _ in range(WARMUP):
        recv()
    lat = []
    cpu0 = time.process_time()
    for _ in range(n):
        data = recv()
        now = time.perf_counter_ns()
        lat.append(now - (data.step if decoded else int.from_bytes(data[off : off + 8], "big")))
    end = time.perf_counter_ns()
    return {"lat_ns": lat, "t_last": end, "cpu_s": time.process_time() - cpu0}


def ring_receiver(run: str, kind: str, n: int, off: int, decode: bool, spin_s: float, q) -> None:
    r = RingReader.attach(run, kind, CODECS[kind](), spin_s=spin_s)
    try:
        q.put(_receive(r.get if decode else r.get_bytes, n, off, decode))
    finally:
        r.close()


def zmq_receiver(addr: str, kind: str, n: int, off: int, decode: bool, q) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.connect(addr)
    codec = CODECS[kind]()
    try:
        recv = (lambda: codec.decode(sock.recv())) if decode else sock.recv
        q.put(_receive(recv, n, off, decode))
    finally:
        sock.close(linger=0)
        ctx.term()


def idle_reader(run: str, seconds: float, q) -> None:
    r = RingReader.attach(run, "idle")
    try:
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.monotonic()
        with contextlib.suppress(RingTimeout):
            r.get_bytes(timeout=seconds)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        q.put(100.0 * cpu / (time.monotonic() - t0))
    finally:
        r.close()


# ------------------------------------------------------------------ senders (this process)


def _send_all(send, raw: bytes, off: int, n: int, gap_ns: int) -> dict:
    msg = bytearray(raw)
    for _ in range(WARMUP):
        send(msg)
    time.sleep(0.05)
    t_first = time.perf_counter_ns()
    cpu0 = time.process_time()
    for _ in range(n):
        if gap_ns:
            time.sleep(gap_ns / 1e9)  # sleeping, not spinning: the sender leaves the CPU free
        msg[off : off + 8] = time.perf_counter_ns().to_bytes(8, "big")
        send(msg)
    return {"t_first": t_first, "cpu_s": time.process_time() - cpu0}


def _summary(sent: dict, got: dict, n: int) -> dict:
    lat = sorted(got["lat_ns"])
    return {
        "p50_us": lat[len(lat) // 2] / 1e3,
        "p99_us": lat[int(len(lat) * 0.99)] / 1e3,
        "msgs_per_s": n / ((got["t_last"] - sent["t_first"]) / 1e9),
        "send_cpu_us": sent["cpu_s"] / n * 1e6,
        "recv_cpu_us": got["cpu_s"] / n * 1e6,
    }


def run_ring(
    ctx, kind: str, raw: bytes, off: int, n: int, gap_ns: int, decode: bool, spin_s: float = DEFAULT_SPIN_S
) -> dict:
    run = f"bench{os.getpid()}"
    w = RingWriter.create(run, kind, DEFAULT_SLOTS, DEFAULT_SLOT_SIZE)
    q = ctx.Queue()
    try:
        p = ctx.Process(target=ring_receiver, args=(run, kind, n, off, decode, spin_s, q))
        p.start()
        w.expect_peer(p.pid)
        while w.peer_pid != p.pid and p.is_alive():  # the reader writes its pid once mapped
            time.sleep(0.01)
        sent = _send_all(lambda m: w.put(m, timeout=60), raw, off, n, gap_ns)
        got = q.get(timeout=300)
        p.join()
    finally:
        w.close()
    return _summary(sent, got, n)


def run_zmq(ctx, kind: str, raw: bytes, off: int, n: int, gap_ns: int, decode: bool) -> dict:
    path = os.path.join(tempfile.gettempdir(), f"agentserve-bench-{os.getpid()}.ipc")
    zctx = zmq.Context()
    sock = zctx.socket(zmq.PUSH)
    sock.bind(f"ipc://{path}")
    q = ctx.Queue()
    try:
        p = ctx.Process(target=zmq_receiver, args=(f"ipc://{path}", kind, n, off, decode, q))
        p.start()
        sent = _send_all(sock.send, raw, off, n, gap_ns)
        got = q.get(timeout=300)
        p.join()
    finally:
        sock.close(linger=0)
        zctx.term()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return _summary(sent, got, n)


def measure_idle(ctx, seconds: float) -> float:
    run = f"bench{os.getpid()}"
    w = RingWriter.create(run, "idle", 4, 64)
    q = ctx.Queue()
    try:
        p = ctx.Process(target=idle_reader, args=(run, seconds, q))
        p.start()
        cpu = q.get(timeout=seconds + 120)
        p.join()
    finally:
        w.close()
    return round(cpu, 3)


def measure(fn, ctx, kind: str, raw: bytes, off: int, args: argparse.Namespace) -> dict:
    lat = fn(ctx, kind, raw, off, args.latency_msgs, int(args.gap_us * 1e3), False)
    parked = fn(ctx, kind, raw, off, args.parked_msgs, 5_000_000, False)
    tput = max((fn(ctx, kind, raw, off, args.throughput_msgs, 0, False) for _ in range(2)),
               key=lambda t: t["msgs_per_s"])
    dec = fn(ctx, kind, raw, off, args.throughput_msgs // 2, 0, True)
    out = {
        "bytes": len(raw),
        "p50_us": round(lat["p50_us"], 2),
        "p99_us": round(lat["p99_us"], 2),
        "parked_p50_us": round(parked["p50_us"], 2),
        "parked_p99_us": round(parked["p99_us"], 2),
        "msgs_per_s": round(tput["msgs_per_s"]),
        "send_cpu_us": round(tput["send_cpu_us"], 2),
        "recv_cpu_us": round(tput["recv_cpu_us"], 2),
        "capacity_msgs_per_s": round(1e6 / max(tput["send_cpu_us"], tput["recv_cpu_us"])),
        "decode_msgs_per_s": round(dec["msgs_per_s"]),
    }
    if fn is run_ring:  # what a reader with a core of its own would do: spin through the gap
        spun = run_ring(ctx, kind, raw, off, args.latency_msgs, int(args.gap_us * 1e3), False, LONG_SPIN_S)
        out.update(spin2ms_p50_us=round(spun["p50_us"], 2), spin2ms_p99_us=round(spun["p99_us"], 2))
    return out


def bench(args: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    out: dict = {"ring": {}, "zmq": {}}
    for kind, (raw, off) in templates().items():
        out["ring"][kind] = measure(run_ring, ctx, kind, raw, off, args)
        out["zmq"][kind] = measure(run_zmq, ctx, kind, raw, off, args)
    ring, zq = out["ring"], out["zmq"]
    out["ratio_p50_latency"] = round(max(ring[k]["p50_us"] / zq[k]["p50_us"] for k in ring), 3)
    out["ratio_throughput"] = round(min(ring[k]["msgs_per_s"] / zq[k]["msgs_per_s"] for k in ring), 2)
    out["idle_cpu_percent"] = measure_idle(ctx, 3.0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one compact JSON line (else indented)")
    ap.add_argument("--latency-msgs", type=int, default=20_000)
    ap.add_argument("--parked-msgs", type=int, default=300)
    ap.add_argument("--throughput-msgs", type=int, default=200_000)
    ap.add_argument("--gap-us", type=float, default=100.0, help="sleep between latency messages")
    args = ap.parse_args()
    print(json.dumps(bench(args), indent=None if args.json else 2), flush=True)


if __name__ == "__main__":
    main()
