"""Latency metrics of a benchmark run, computed from per-request timelines.

Conventions (those of ``vllm bench serve`` / SGLang ``bench_serving`` where not said otherwise):

* TTFT = first token arrival − send time; E2E = last token arrival − send time (vLLM takes the stream's end, a few
  ms later; every system here is measured the same way);
* TPOT = (E2E − TTFT) / (n − 1) for a request of n output tokens (undefined for n = 1);
* ITL = the gap between consecutive *chunks* as the client receives them (a chunk that carries
  several tokens counts once: vLLM's rule; SGLang splits such a gap over its tokens);
* SLO attainment = share of the requests sent (finished or failed) that finished with TTFT ≤ SLO and
  TPOT ≤ SLO (a one-token request has no TPOT and is judged on TTFT only; a failed one meets neither, but it also
  ends its agent, whose later turns are never sent: compare attainment only in runs without errors, which bench
  exits non-zero on); goodput = the requests that met both per second of the run (vLLM's request goodput);
  token throughput = output tokens per second of the run.  Rates count what happened *in* the measured window
  (from the end of the warm-up to the deadline) and divide by it: the output tokens whose chunks arrived in it,
  the requests that finished in it (whenever sent).  So they are exact with or without a warm-up: a turn in flight
  at either edge counts for the part of it inside, and the drain after the deadline (a system's own slowest turns)
  counts nowhere.  Latencies and SLO attainment are of the requests *sent* in the window; task time is of the tasks
  started in it that finished by the deadline (the longest tasks are the likeliest to straddle an edge, so its
  mean leans a little short).

All times are seconds of one monotonic clock (``time.perf_counter``); reports convert to ms.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np


@dataclass
class RequestRecord:
    """What the client saw of one turn: when it was sent and when each chunk of tokens arrived."""

    agent: int
    task: int
    step: int
    kind: str  # "cold" | "resume"
    prompt_tokens: int
    max_tokens: int
    sent: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival time, tokens in it)
    error: str | None = None

    @property
    def n_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def ok(self) -> bool:
        return self.error is None and self.n_tokens > 0

    @property
    def ttft(self) -> float:
        return self.chunks[0][0] - self.sent

    @property
    def e2e(self) -> float:
        return self.chunks[-1][0] - self.sent

    @property
    def tpot(self) -> float | None:
        n = self.n_tokens
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        times = [t for t, _ in self.chunks]
        return [b - a for a, b in zip(times, times[1:], strict=False)]


@dataclass
class TaskRecord:
    """One agent task: from the send of its cold turn to the last token of its last turn."""

    agent: int
    task: int
    start: float
    end: float | None = None  # None: cut off by the end of the run or by an error

    @property
    def duration(self) -> float | None:
        return None if self.end is None else self.end - self.start


@dataclass
class RunRecord:
    """Everything one benchmark run of one system recorded."""

    start: float
    end: float  # the later of the deadline and the last token
    requests: list[RequestRecord] = field(default_factory=list)
    tasks: list[TaskRecord] = field(default_factory=list)
    window_s: float | None = None  # the seconds measured: from start to the deadline (None: to the end)
    earlier: list[RequestRecord] = field(default_factory=list)  # sent before start: only their tokens in it count
    parts: list[RunRecord] = field(default_factory=list)  # pooled: the runs it pools, as they were (for rates)

    @property
    def elapsed(self) -> float:
        return self.end - self.start

    @property
    def measured_s(self) -> float:
        """What rates divide by: the window asked for, never the drain after it."""
        return self.elapsed if self.window_s is None else self.window_s


def after_warmup(run: RunRecord, warmup_s: float) -> RunRecord:
    """The part of ``run`` measured after ``warmup_s``: requests and tasks that *started* later (the requests
    sent before stay in ``earlier``, for the tokens they streamed after it)."""
    if run.parts:
        raise ValueError("a warm-up is cut off each run before pooling")
    start = run.start + warmup_s
    window = None if run.window_s is None else max(0.0, run.window_s - warmup_s)
    return RunRecord(start, max(run.end, start), [r for r in run.requests if r.sent >= start],
                     [t for t in run.tasks if t.start >= start], window,
                     run.earlier + [r for r in run.requests if r.sent < start])


def pool(runs: list[RunRecord]) -> RunRecord:
    """Several runs of one system laid end to end on one time axis: each is shifted to start where the
    previous one ended, so rates divide by the summed run time and percentiles cover every request."""
    if not runs:
        raise ValueError("nothing to pool")
    out = RunRecord(runs[0].start, runs[0].start, window_s=0.0, parts=list(runs))
    for run in runs:
        shift = out.end - run.start
        out.requests += [replace(r, sent=r.sent + shift, chunks=[(t + shift, n) for t, n in r.chunks])
                         for r in run.requests]
        out.tasks += [replace(t, start=t.start + shift, end=None if t.end is None else t.end + shift)
                      for t in run.tasks]
        out.end += run.elapsed
        out.window_s += run.measured_s
    return out


def in_window(run: RunRecord) -> tuple[int, list[RequestRecord]]:
    """The output tokens whose chunks arrived in the measured window (ends included), and the replies that
    finished in it, whenever sent; of a pooled record, those of every run it pools, each in its own window."""
    if run.parts:
        each = [in_window(part) for part in run.parts]
        return sum(tokens for tokens, _ in each), [r for _, finished in each for r in finished]
    start, stop = run.start, run.start + run.measured_s
    streamed = [r for r in run.earlier + run.requests if r.ok]
    tokens = sum(n for r in streamed for t, n in r.chunks if start <= t <= stop)
    return tokens, [r for r in streamed if start <= r.chunks[-1][0] <= stop]


@dataclass(frozen=True)
class SLO:
    ttft_s: float = 2.0
    tpot_s: float = 0.1

    def met(self, r: RequestRecord) -> bool:
        tpot = r.tpot
        return r.ttft <= self.ttft_s and (tpot is None or tpot <= self.tpot_s)


def summary(values: list[float], scale: float = 1.0) -> dict[str, float | int | None]:
    """mean / p50 / p95 / p99 (linear interpolation, as ``numpy.percentile``) and the population standard
    deviation (the spread the "latency variance" ablation compares), times ``scale``."""
    if not values:
        return {"count": 0, "mean": None, "p50": None, "p95": None, "p99": None, "std": None}
    a = np.asarray(values, dtype=float) * scale
    p50, p95, p99 = np.percentile(a, [50, 95, 99])
    return {"count": len(values), "mean": float(a.mean()), "p50": float(p50), "p95": float(p95),
            "p99": float(p99), "std": float(a.std())}


def _share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def aggregate(run: RunRecord, slo: SLO) -> dict:
    """The figures of one run (latencies in ms, task times in s, rates per second)."""
    done = [r for r in run.requests if r.ok]
    ms = 1000.0
    measured = max(run.measured_s, 1e-9)
    good = sum(slo.met(r) for r in done)
    window_tokens, finished = in_window(run)
    tpots = [r.tpot for r in done if r.tpot is not None]
    failed = len(run.requests) - len(done)  # each a miss of both SLOs
    return {
        "requests": len(done),
        "errors": failed,
        "short_replies": sum(r.n_tokens < r.max_tokens for r in done),  # every driver asks ignore_eos
        "elapsed_s": run.elapsed,
        "measured_s": run.measured_s,
        "ttft": summary([r.ttft for r in done], ms),
        "ttft_cold": summary([r.ttft for r in done if r.kind == "cold"], ms),
        "ttft_resume": summary([r.ttft for r in done if r.kind == "resume"], ms),
        "tpot": summary(tpots, ms),
        "itl": summary([x for r in done for x in r.itls], ms),
        "e2e": summary([r.e2e for r in done], ms),
        "task_time_s": summary([t.duration for t in run.tasks if t.duration is not None]),
        "tasks_completed": sum(t.end is not None for t in run.tasks),
        "output_tokens": window_tokens,
        "throughput_tok_s": window_tokens / measured,
        "request_throughput": len(finished) / measured,
        "slo_attainment": _share(good, len(run.requests)),
        "ttft_slo_attainment": _share(sum(r.ttft <= slo.ttft_s for r in done), len(run.requests)),
        "tpot_slo_attainment": _share(sum(t <= slo.tpot_s for t in tpots), len(tpots) + failed),
        "goodput": sum(slo.met(r) for r in finished) / measured,
    }
