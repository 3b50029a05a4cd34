"""Closed-loop agent workloads: a seeded, deterministic script for every agent.

A task is a list of turns. Turn 0 is the *cold* prefill (the shared system prompt + tool schema
prefix, then this task's own text); every later turn is a *resume*: the agent waits for its tool
(log-normal latency) and appends the tool output (the resume prefill). Each turn decodes a fixed
number of tokens with ignore-eos, so every system under test does exactly the same work.

Everything an agent does is a pure function of ``(seed, agent, task index)``, so two runs with the
same seed replay identical token ids and timings however the server under test paces them.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentserve import configs


@dataclass(frozen=True)
class Span:
    """Integer lengths in ``[min, max]`` from a Beta distribution scaled to that range with this mean."""

    min: int
    max: int
    mean: float
    concentration: float = 6.0

    def __post_init__(self) -> None:
        if not self.min <= self.mean <= self.max or self.min < 0:
            raise ValueError(f"need 0 <= min <= mean <= max, got {self}")
        if self.concentration <= 0:
            raise ValueError(f"concentration must be > 0, got {self.concentration}")

    def draw(self, rng: random.Random) -> int:
        if self.max == self.min:
            return self.min
        mu = (self.mean - self.min) / (self.max - self.min)
        mu = min(max(mu, 1e-3), 1 - 1e-3)
        x = rng.betavariate(mu * self.concentration, (1 - mu) * self.concentration)
        return min(self.max, max(self.min, round(self.min + x * (self.max - self.min))))


@dataclass(frozen=True)
class ToolLatency:
    """Log-normal tool latency: ``median_s * exp(sigma * N(0, 1))``; ``median_s = 0`` disables it."""

    median_s: float = 1.0
    sigma: float = 0.5

    def __post_init__(self) -> None:
        if not (math.isfinite(self.median_s) and math.isfinite(self.sigma) and self.median_s >= 0 <= self.sigma):
            raise ValueError(f"tool latency needs a finite median_s >= 0 and sigma >= 0, got {self}")

    def draw(self, rng: random.Random) -> float:
        if self.median_s <= 0:
            return 0.0
        return rng.lognormvariate(math.log(self.median_s), self.sigma)


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    agents: int
    steps_per_task: int
    seed: int
    shared_prefix_tokens: int
    vocab_low: int
    vocab_high: int
    cold_prefill: Span
    resume_prefill: Span
    decode: Span
    tool_latency: ToolLatency
    agent_start_stagger_s: float = 0.0

    def __post_init__(self) -> None:
        if self.agents < 1 or self.steps_per_task < 1:
            raise ValueError("agents and steps_per_task must be >= 1")
        if not 0 <= self.vocab_low < self.vocab_high:
            raise ValueError(f"bad vocab range [{self.vocab_low}, {self.vocab_high})")
        if self.shared_prefix_tokens >= self.cold_prefill.min:
            raise ValueError("shared_prefix_tokens must be shorter than the shortest cold prefill")


@dataclass(frozen=True)
class TurnScript:
    """One LLM request of an agent.

    ``prompt_ids`` are the tokens this turn *appends* to the conversation (the whole first prompt
    for a cold turn, the tool output for a resume). ``wait_s`` is the tool latency the agent sleeps
    before sending it (0 for the cold turn).
    """

    kind: str  # "cold" | "resume"
    prompt_ids: tuple[int, ...]
    decode_tokens: int
    wait_s: float


@dataclass(frozen=True)
class Task:
    agent: int
    index: int
    turns: tuple[TurnScript, ...]


def _ids(rng: random.Random, n: int, spec: WorkloadSpec) -> tuple[int, ...]:
    return tuple(rng.randrange(spec.vocab_low, spec.vocab_high) for _ in range(n))


class Workload:
    """Deterministic generator of agent tasks for one :class:`WorkloadSpec`."""

    def __init__(self, spec: WorkloadSpec) -> None:
        self.spec = spec
        self.shared_prefix = _ids(random.Random(f"{spec.seed}:prefix"), spec.shared_prefix_tokens, spec)

    def task(self, agent: int, index: int) -> Task:
        """The ``index``-th task of ``agent`` (a pure function of seed, agent and index)."""
        s = self.spec
        rng = random.Random(f"{s.seed}:{agent}:{index}")
        cold_len = s.cold_prefill.draw(rng)
        turns = [TurnScript("cold", self.shared_prefix + _ids(rng, cold_len - len(self.shared_prefix), s),
                      s.decode.draw(rng), 0.0)]
        for _ in range(s.steps_per_task - 1):
            wait = s.tool_latency.draw(rng)
            turns.append(TurnScript("resume", _ids(rng, s.resume_prefill.draw(rng), s), s.decode.draw(rng), wait))
        return Task(agent, index, tuple(turns))

    def start_offset(self, agent: int) -> float:
        return agent * self.spec.agent_start_stagger_s


def _span(table: dict[str, Any]) -> Span:
    return Span(int(table["min"]), int(table["max"]), float(table["mean"]),
                float(table.get("concentration", 6.0)))


def spec_from_dict(d: dict[str, Any]) -> WorkloadSpec:
    """Build a spec from a parsed workload TOML (the ``[workload]`` table or the whole file); ``ValueError`` for a
    missing key or a value of the wrong type, naming it."""
    try:
        return _spec(d.get("workload", d))
    except KeyError as e:
        raise ValueError(f"the workload has no {e.args[0]!r}") from None
    except (TypeError, AttributeError) as e:
        raise ValueError(f"a workload value has the wrong type: {e}") from None


def _spec(w: dict[str, Any]) -> WorkloadSpec:
    tl = w.get("tool_latency", {})
    return WorkloadSpec(
        name=str(w.get("name", "custom")),
        agents=int(w.get("agents", 4)),
        steps_per_task=int(w["steps_per_task"]),
        seed=int(w.get("seed", 0)),
        shared_prefix_tokens=int(w["shared_prefix_tokens"]),
        vocab_low=int(w.get("vocab_low", 10)),
        vocab_high=int(w.get("vocab_high", 250)),
        cold_prefill=_span(w["cold_prefill"]),
        resume_prefill=_span(w["resume_prefill"]),
        decode=_span(w["decode"]),
        tool_latency=ToolLatency(float(tl.get("median_s", 1.0)), float(tl.get("sigma", 0.5))),
        agent_start_stagger_s=float(w.get("agent_start_stagger_s", 0.0)),
    )


def load_spec(name_or_file: str, **overrides: Any) -> WorkloadSpec:
    """A packaged workload (``react``, ``plan-execute``) or a TOML file, with top-level overrides.

    ``overrides`` replace keys of the ``[workload]`` table (``None`` values are ignored);
    ``tool_latency_median_s`` / ``tool_latency_sigma`` set the tool-latency table.
    """
    if Path(name_or_file).suffix == ".toml" or Path(name_or_file).is_file():
        d = configs.read_file(name_or_file)
    else:
        d = configs.packaged(f"workloads/{name_or_file}")
    w = dict(d.get("workload", d))
    tl = dict(w.get("tool_latency", {}))
    for key, value in overrides.items():
        if value is None:
            continue
        if key.startswith("tool_latency_"):
            tl[key.removeprefix("tool_latency_")] = value
        else:
            w[key] = value
    w["tool_latency"] = tl
    return spec_from_dict(w)
