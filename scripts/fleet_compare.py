#!/usr/bin/env python
"""Does an agent keep its box?  ``agentserve bench`` through ``agentserve fleet up`` under each router policy.

    python scripts/fleet_compare.py --policies cache_aware,round_robin --duration 60 --json fleet.json
    python scripts/fleet_compare.py --policies cache_aware --kill-at 20 --restart-after 10

``cache_aware@0.3`` runs cache_aware with ``--cache-threshold 0.3`` (the router's default) instead of
configs/fleet.toml's.

For every policy: a fresh fleet (``--workers`` workers of ``--model``), the react workload through the
router with the ``chat`` dialect, the workers' ``/metrics`` scraped before and after.  Reported:

* **resume turns served from cache**: the turns the workers' gateways continued from a session they held
  (Σ ``agentserve:conversation_continuations_total``) over the resume turns the bench sent. A resume that
  lands on another worker starts a new session there and prefills the whole conversation again;
* the prompt tokens served from the KV cache (Σ ``prefix_cache_hits`` / Σ ``prefix_cache_queries``);
* how the requests spread over the workers, and the bench's resume and cold TTFT p95, errors.

``--kill-at S`` SIGKILLs worker 0's ``agentserve up`` S seconds into the run and, ``--restart-after R``
seconds later, starts it again on the same port; the router's view of each worker's health is sampled
every second and the slowest turn is reported (a hung turn would show there).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from agentserve.cli.fleet import parse_ready_line
from agentserve.cli.fleet_members import agentserve_executable, worker_command
from agentserve.protocol.endpoints import default_endpoint

COUNTERS = ("request_success_total", "conversation_continuations_total", "prefix_cache_hits_total",
            "prefix_cache_queries_total", "prefix_cache_hits_by_class_total:resume",
            "prefix_cache_queries_by_class_total:resume")


def counters(url: str) -> dict[str, float]:
    """Sums of the counters above in a worker's ``/metrics`` (``name:class`` for a class; zeros if it does
    not answer)."""
    out = dict.fromkeys(COUNTERS, 0.0)
    try:
        text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    except OSError:
        return out
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removeprefix("agentserve:")
            key = f"{name}:{sample.labels['class']}" if "class" in sample.labels else name
            if key in out and sample.name.startswith("agentserve:"):
                out[key] += sample.value
    return out


def start_fleet(args: argparse.Namespace, policy: str, log_dir: Path) -> tuple[subprocess.Popen, dict]:
    policy, _, threshold = policy.partition("@")  # cache_aware@0.3: another --cache-threshold
    extra = ["--router-arg=--cache-threshold", f"--router-arg={threshold}"] if threshold else []
    cmd = [agentserve_executable(), "fleet", "up", "--workers", str(args.workers), "--model", args.model,
           "--policy", policy, "--port", "0", "--worker-base-port", "0", "--metrics-port", "0", *extra,
           "--name", f"cmp{os.getpid()}", "--log-dir", str(log_dir),
           *[f"--server-arg={a}" for a in args.server_arg]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("AgentServe fleet ready"):
        proc.wait(30)
        raise SystemExit(f"fleet up failed (exit {proc.returncode}); logs in {log_dir}")
    return proc, parse_ready_line(line)


def health_sampler(router: str, stop: threading.Event, samples: list) -> None:
    while not stop.wait(1.0):
        try:
            workers = json.load(urllib.request.urlopen(router + "/workers", timeout=2))["workers"]
            samples.append((time.time(), {w["url"]: w["is_healthy"] for w in workers}))
        except (OSError, ValueError, KeyError):
            samples.append((time.time(), {}))


def fault(args: argparse.Namespace, fleet: dict, log_dir: Path) -> tuple[dict, subprocess.Popen]:
    """Kill worker 0's `up` at --kill-at, restart it --restart-after later; when each happened."""
    run = f"cmp{os.getpid()}-w0"
    time.sleep(args.kill_at)
    pid = int(subprocess.run(["pgrep", "-f", f"agentserve up .*--run {run} "], capture_output=True, text=True)
              .stdout.split()[0])
    last = counters(fleet["workers"][0])  # its counters start again at zero when it is restarted
    os.kill(pid, signal.SIGKILL)
    killed = time.time()
    time.sleep(args.restart_after)
    host, port = fleet["workers"][0].removeprefix("http://").rsplit(":", 1)
    cmd = worker_command(args.model, run, host, int(port), default_endpoint(run), list(args.server_arg))
    with (log_dir / "worker0-restarted.log").open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    return {"killed": killed, "restarted": time.time(), "worker0_before_kill": last}, proc


def run_policy(args: argparse.Namespace, policy: str) -> dict:
    log_dir = Path(tempfile.mkdtemp(prefix=f"fleet-{policy.replace('@', '-')}-"))
    proc, fleet = start_fleet(args, policy, log_dir)
    restarted = None
    try:
        before = {w: counters(w) for w in fleet["workers"]}
        bench_json = log_dir / "bench.json"
        bench = subprocess.Popen(
            [agentserve_executable(), "bench", "--target", fleet["router"], "--target-dialect", "chat",
             "--target-model", args.model, "--agents", str(args.agents), "--steps", str(args.steps),
             "--duration", str(args.duration), "--json", str(bench_json)],
            stdout=(log_dir / "bench.log").open("w"), stderr=subprocess.STDOUT)
        samples: list = []
        stop = threading.Event()
        sampler = threading.Thread(target=health_sampler, args=(fleet["router"], stop, samples), daemon=True)
        sampler.start()
        events = {}
        if args.kill_at is not None:
            events, restarted = fault(args, fleet, log_dir)
        bench.wait()
        stop.set()
        after = {w: counters(w) for w in fleet["workers"]}
        if events:  # worker 0's whole run: up to the kill, plus the restarted worker's counters
            w0 = fleet["workers"][0]
            after[w0] = {k: v + events["worker0_before_kill"][k] for k, v in after[w0].items()}
        report = json.loads(bench_json.read_text())["policies"]["target"]
        return summarise(policy, fleet, before, after, report, samples, events,
                         (log_dir / "bench.log").read_text(errors="replace"))
    finally:
        for p in (restarted, proc):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(60)


def summarise(policy: str, fleet: dict, before: dict, after: dict, report: dict, samples: list, events: dict,
              bench_log: str) -> dict:
    delta = {w: {k: after[w][k] - before[w][k] for k in COUNTERS} for w in fleet["workers"]}
    resumes = report["ttft_resume"]["count"]
    continued = sum(d["conversation_continuations_total"] for d in delta.values())
    hits = sum(d["prefix_cache_hits_total"] for d in delta.values())
    queries = sum(d["prefix_cache_queries_total"] for d in delta.values())
    resume_hits = sum(d["prefix_cache_hits_by_class_total:resume"] for d in delta.values())
    resume_queries = sum(d["prefix_cache_queries_by_class_total:resume"] for d in delta.values())
    turns = sum(d["request_success_total"] for d in delta.values())
    out = {
        "policy": policy, "turns": report["requests"], "errors": report["errors"], "resume_turns": resumes,
        "resume_turns_from_cache": continued / resumes if resumes else None,
        "continued_prompt_tokens_cached": resume_hits / resume_queries if resume_queries else None,
        "prompt_tokens_cached": hits / queries if queries else None,
        "tokens_prefilled_per_turn": (queries - hits) / turns if turns else None,
        "requests_per_worker": [d["request_success_total"] for d in delta.values()],
        "ttft_resume_p50_ms": report["ttft_resume"]["p50"], "ttft_resume_p95_ms": report["ttft_resume"]["p95"],
        "ttft_cold_p95_ms": report["ttft_cold"]["p95"], "e2e_p99_ms": report["e2e"]["p99"],
        "error_lines": [ln for ln in bench_log.splitlines() if "failed:" in ln],
    }
    if events:
        w0 = fleet["workers"][0]
        down = [t for t, h in samples if t > events["killed"] and h.get(w0) is False]
        back = [t for t, h in samples if t > events["restarted"] and h.get(w0) is True]
        out["worker0_unhealthy_after_s"] = round(down[0] - events["killed"], 1) if down else None
        out["worker0_healthy_after_restart_s"] = round(back[0] - events["restarted"], 1) if back else None
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default="cache_aware,round_robin")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--model", default="tiny")
    p.add_argument("--agents", type=int, default=8)
    p.add_argument("--steps", type=int, default=6, help="turns per task (tiny's context is 4096 tokens)")
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--kill-at", type=float, default=None, help="SIGKILL worker 0 this many s into the run")
    p.add_argument("--restart-after", type=float, default=10.0)
    p.add_argument("--server-arg", action="append", default=[], help="extra argument for every worker")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    results = [run_policy(args, policy.strip()) for policy in args.policies.split(",") if policy.strip()]
    for r in results:
        print(json.dumps({k: v for k, v in r.items() if k != "error_lines"}))
        for line in r["error_lines"][:10]:
            print("   ", line)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
