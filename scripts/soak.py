#!/usr/bin/env python
"""Soak test: N tool-loop agents for M minutes against ``agentserve up``, with faults on a schedule.

    python scripts/soak.py --minutes 10 --agents 8 --json soak.json

Every ``--fault-every`` seconds one fault, in turn: a client killed mid-stream, a client frozen
(SIGSTOP) mid-stream, the executor killed, the executor frozen (a hang), a burst of hostile frames
(deep nesting, garbage, an oversized stop list).  The agents run short ReAct loops (a turn, a tool
pause, a resume) in raw-token mode and retry a turn the server refused while its executor restarted.

Counted: **lost** turns (the stream broke without a ``done`` or a typed error), **hung** turns (no
event for ``--event-timeout`` s), turns done, typed errors by code; sampled every 10 s: orchestrator
and executor RSS, KV blocks in use, sessions.  At the end every agent closes its session, the KV in
use must return to zero (**leaked blocks** otherwise), the server is stopped with SIGTERM (exit code
0 expected) and ``/dev/shm`` must hold nothing of the run (**leaked segments**).  Exit code 1 when any
of lost, hung, leaked blocks or leaked segments is not zero.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from agentserve.client import AgentClient, AgentServeError, ServerDisconnected, ServerUnavailable
from agentserve.protocol.client_messages import ClientCodec, Turn
from agentserve.protocol.stats import decode_snapshot

CONFIG = """
[clients]
stall_timeout_s = 2.0
[executor]
hang_floor_s = 4.0
"""

TURNS_PER_TASK = 8

VICTIM = """
import sys, time
from agentserve.client import AgentClient
with AgentClient(sys.argv[1]) as client:
    s = client.session(name="victim")
    for event in s.turn(token_ids=[5] * 64, max_tokens=1500, ignore_eos=True):
        print("streaming", flush=True)
        break
    time.sleep(600)
"""


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: int = 0
    lost: int = 0
    hung: int = 0
    errors: Counter = field(default_factory=Counter)

    def add(self, what: str) -> None:
        with self.lock:
            if what in ("done", "lost", "hung"):
                setattr(self, what, getattr(self, what) + 1)
            else:
                self.errors[what] += 1


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run = f"soak{uuid.uuid4().hex[:6]}"
        self.tmp = Path(tempfile.mkdtemp(prefix="agentserve-soak-"))
        self.endpoint = f"ipc://{self.tmp}/soak.sock"
        self.tally = Tally()
        self.stop = threading.Event()
        self.samples: list[dict] = []
        self.faults: list[dict] = []

    # ---- the server ------------------------------------------------------------------------------
    def start_server(self) -> None:
        (self.tmp / "limits.toml").write_text(CONFIG)
        cmd = ["agentserve", "up", "--model", self.args.model, "--run", self.run, "--endpoint", self.endpoint,
               "--config", str(self.tmp / "limits.toml"), "--log-level", "WARNING"]
        self.log = open(self.tmp / "up.log", "w+")  # noqa: SIM115 - closed at the end
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.proc.stdout.readline()
        if "ready on" not in line:
            raise SystemExit(f"the server did not start: {line!r}; see {self.tmp / 'up.log'}")

    def executor_pid(self) -> int | None:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        pids = [int(p) for p in out if _is_executor(int(p))]
        return pids[0] if pids else None

    # ---- agents ----------------------------------------------------------------------------------
    def agent(self, i: int) -> None:
        rng = random.Random(i)
        while not self.stop.is_set():
            try:
                with AgentClient(self.endpoint, event_timeout=self.args.event_timeout, name=f"agent{i}") as client:
                    self._loop(client, rng, i)
                return
            except ServerUnavailable:
                time.sleep(1.0)  # counted where it happened; reconnect

    def _loop(self, client: AgentClient, rng: random.Random, i: int) -> None:
        """Tasks of ``TURNS_PER_TASK`` turns, each task its own session (a cold prefill, then resumes)."""
        while not self.stop.is_set():
            with client.session(name=f"agent{i}") as session:
                prompt = [rng.randrange(10, 200) for _ in range(rng.randint(200, 600))]
                for _ in range(TURNS_PER_TASK):
                    if self.stop.is_set():
                        return
                    self._turn(session, prompt, rng)
                    prompt = [rng.randrange(10, 200) for _ in range(rng.randint(30, 120))]
                    time.sleep(rng.uniform(0.1, 1.0))  # the tool runs

    def _turn(self, session, prompt: list[int], rng: random.Random) -> None:
        try:
            session.turn(token_ids=prompt, max_tokens=rng.randint(20, 60), ignore_eos=True).collect()
            self.tally.add("done")
        except ServerDisconnected:
            self.tally.add("lost")  # the stream broke without a done or a typed error
            raise
        except ServerUnavailable:
            self.tally.add("hung")  # no event for --event-timeout seconds
            raise
        except AgentServeError as e:
            self.tally.add(e.code.value if e.code is not None else type(e).__name__)
            time.sleep(0.5)

    # ---- faults ----------------------------------------------------------------------------------
    def inject(self, kind: str) -> None:
        t = time.monotonic()
        if kind in ("client_kill", "client_freeze"):
            victim = subprocess.Popen([sys.executable, "-c", VICTIM, self.endpoint], stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True)
            victim.stdout.readline()
            victim.send_signal(signal.SIGKILL if kind == "client_kill" else signal.SIGSTOP)
            if kind == "client_freeze":
                time.sleep(self.args.fault_every / 2)
            victim.kill()
            victim.wait()
        elif kind in ("executor_kill", "executor_hang"):
            pid = self.executor_pid()
            if pid is not None:
                os.kill(pid, signal.SIGKILL if kind == "executor_kill" else signal.SIGSTOP)
        elif kind == "bad_frames":
            self._bad_frames()
        self.faults.append({"t": round(t - self.t0, 1), "fault": kind})

    def _bad_frames(self) -> None:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        codec = ClientCodec()
        frames = [b"\x91" * 5000 + b"\xc0", os.urandom(300), b"\x95\xa4open\x01\x01\xa0\x91" + b"\x81\xa1a" * 5000,
                  codec.encode(Turn(req=2, session=1, token_ids=[1], stop=["s"] * 100_000))]
        for frame in frames:
            sock.send(frame)
        time.sleep(0.5)
        sock.close()

    def sample(self) -> None:
        try:
            with AgentClient(self.endpoint, timeout=5.0) as client:
                snap = decode_snapshot(client.stats())
        except AgentServeError:
            return
        pid = self.executor_pid()
        self.samples.append({
            "t": round(time.monotonic() - self.t0, 1), "rss_orchestrator_mb": _rss_mb(self.proc.pid),
            "rss_executor_mb": _rss_mb(pid) if pid else 0.0, "kv_used_blocks": snap.kv.used_blocks,
            "sessions": len(snap.sessions),
        })  # fmt: skip

    # ---- the run ---------------------------------------------------------------------------------
    def go(self) -> dict:
        self.start_server()
        self.t0 = time.monotonic()
        agents = [threading.Thread(target=self.agent, args=(i,), daemon=True) for i in range(self.args.agents)]
        for a in agents:
            a.start()
        kinds = ["client_kill", "client_freeze", "executor_kill", "executor_hang", "bad_frames"]
        next_fault, next_sample, k = self.args.fault_every, 0.0, 0
        while (now := time.monotonic() - self.t0) < self.args.minutes * 60:
            if now >= next_sample:
                self.sample()
                next_sample += 10.0
            if now >= next_fault:
                self.inject(kinds[k % len(kinds)])
                k += 1
                next_fault += self.args.fault_every
            time.sleep(0.2)
        self.stop.set()
        for a in agents:
            a.join(self.args.event_timeout + 30)
        return self.finish()

    def finish(self) -> dict:
        time.sleep(1.0)
        self.sample()
        leaked_blocks = self.samples[-1]["kv_used_blocks"] if self.samples else -1
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.log.close()
        segments = [n for n in os.listdir("/dev/shm") if self.run in n]
        return {
            "minutes": self.args.minutes, "agents": self.args.agents, "turns_done": self.tally.done,
            "lost_turns": self.tally.lost, "hung_turns": self.tally.hung, "typed_errors": dict(self.tally.errors),
            "leaked_blocks": leaked_blocks, "leaked_segments": segments, "exit_code": code, "faults": self.faults,
            "samples": self.samples, "log": str(self.tmp / "up.log"),
        }  # fmt: skip


def _is_executor(pid: int) -> bool:
    try:
        return b"agentserve.executor" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return 0.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--agents", type=int, default=8)
    p.add_argument("--model", default="tiny")
    p.add_argument("--fault-every", type=float, default=20.0, help="seconds between faults")
    p.add_argument("--event-timeout", type=float, default=60.0, help="a turn with no event this long is hung")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    report = Soak(args).go()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    rss = [(s["rss_orchestrator_mb"], s["rss_executor_mb"]) for s in report["samples"]]
    print(json.dumps({k: v for k, v in report.items() if k not in ("samples", "faults")}))
    if rss:
        print(f"RSS orchestrator {rss[0][0]} → {rss[-1][0]} MB, executor {rss[0][1]} → {rss[-1][1]} MB "
              f"over {len(rss)} samples; {len(report['faults'])} faults")
    bad = report["lost_turns"] or report["hung_turns"] or report["leaked_blocks"] or report["leaked_segments"]
    return 1 if bad or report["exit_code"] != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
