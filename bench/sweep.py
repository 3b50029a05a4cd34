"""An agent-count sweep: every system at every agent count, a fresh server for each run.

The order is fixed and part of the contract (tests check it): agent counts in the order given; at each
count, repeat 0 of every system, then repeat 1 of every system, ..., each repeat starting one system further
along the list (A B, B A, A B, ...: no system always runs first on a machine that just sat idle, nor always
right after another's server); repeat ``i`` uses workload seed ``seed + i`` at every count, so agent ``k``'s
script at 4 agents is the one it had at 2. A system that fails (its server does not start, or the run raises)
is skipped for the rest of that count and its runs there are dropped, so each system kept at a count has one
run per repeat; it is tried again at the next count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from agentserve.bench.metrics import RunRecord
from agentserve.bench.workload import WorkloadSpec


@dataclass(frozen=True)
class RunSlot:
    """One run of the sweep: ``system`` at ``agents`` agents, repeat ``repeat`` with workload ``seed``."""

    index: int
    agents: int
    repeat: int
    system: str
    seed: int


def parse_agent_counts(text: str) -> list[int]:
    """``"1,2,4"`` → ``[1, 2, 4]``; each count ≥ 1, no duplicates, order kept."""
    counts = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"agent counts are integers >= 1, got {part!r}")
        if int(part) in counts:
            raise ValueError(f"agent count {part} given twice")
        counts.append(int(part))
    if not counts:
        raise ValueError("no agent count given")
    return counts


def plan(agent_counts: list[int], systems: list[str], repeats: int, seed: int) -> list[RunSlot]:
    """Every run of the sweep, in the order they execute."""
    if repeats < 1 or not systems or not agent_counts:
        raise ValueError("a sweep needs >= 1 repeat, >= 1 system and >= 1 agent count")
    slots = []
    for n in agent_counts:
        for rep in range(repeats):
            turn = rep % len(systems)
            for name in systems[turn:] + systems[:turn]:
                slots.append(RunSlot(len(slots), n, rep, name, seed + rep))
    return slots


@dataclass
class SweepRuns:
    """What a sweep recorded: runs per agent count and system (one per repeat), failures per count."""

    runs: dict[int, dict[str, list[RunRecord]]] = field(default_factory=dict)
    failed: dict[int, list[str]] = field(default_factory=dict)

    def at(self, agents: int) -> dict[str, list[RunRecord]]:
        return self.runs.get(agents, {})


# launch(system, spec of this point) -> a context manager that yields a target for ``drive``
Launch = Callable[[str, WorkloadSpec], AbstractContextManager[Any]]
# drive(target, spec of this run, slot) -> the run's record (warm-up already cut off)
Drive = Callable[[Any, WorkloadSpec, RunSlot], RunRecord]
# on_event(event, slot, error): "start" before the launch, then one of "ran" | "failed" (with the
# exception) | "skipped" (the system failed earlier at this agent count)
OnEvent = Callable[[str, RunSlot, BaseException | None], None]


def spec_for(base: WorkloadSpec, slot: RunSlot) -> WorkloadSpec:
    """The workload of one run: the base spec with this slot's agent count and seed."""
    return dataclasses.replace(base, agents=slot.agents, seed=slot.seed)


def execute(slots: list[RunSlot], base: WorkloadSpec, launch: Launch, drive: Drive,
            on_event: OnEvent | None = None) -> SweepRuns:
    """Run every slot in order, each against a freshly launched system (see the module docstring)."""
    out = SweepRuns()
    tell = on_event or (lambda *_: None)
    for slot in slots:
        failed = out.failed.setdefault(slot.agents, [])
        if slot.system in failed:
            tell("skipped", slot, None)
            continue
        tell("start", slot, None)
        spec = spec_for(base, slot)
        try:
            with launch(slot.system, spec) as target:
                run = drive(target, spec, slot)
        except Exception as e:  # noqa: BLE001 - a failing system is a result; go on with the next
            failed.append(slot.system)
            out.runs.get(slot.agents, {}).pop(slot.system, None)
            tell("failed", slot, e)
            continue
        out.runs.setdefault(slot.agents, {}).setdefault(slot.system, []).append(run)
        tell("ran", slot, None)
    out.failed = {n: names for n, names in out.failed.items() if names}
    return out
