"""Policy registry: ``make_policy(name, config, ladder)``; ``--policy`` accepts ``POLICY_NAMES``."""

from __future__ import annotations

from agentserve.orchestrator.policies.agentserve import AgentServe, NoFeedback, NoPartition
from agentserve.orchestrator.policies.base import Policy
from agentserve.orchestrator.policies.baselines import Chunked, Fcfs, LlamaCpp
from agentserve.orchestrator.scheduler.config import SchedulerConfig
from agentserve.orchestrator.scheduler.rungs import Ladder
from agentserve.protocol.lanes import Rung

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (AgentServe, Fcfs, Chunked, LlamaCpp, NoFeedback, NoPartition)
}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)

SINGLE_RUNG = [Rung(index=0, decode_units=1, prefill_units=0, partitioned=False)]


def make_policy(name: str, config: SchedulerConfig | None = None, ladder: Ladder | None = None) -> Policy:
    """The policy called ``name``; without a ladder, a single unpartitioned rung is assumed."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; valid: {', '.join(POLICY_NAMES)}") from None
    config = config or SchedulerConfig()
    if ladder is None:
        ladder = Ladder(SINGLE_RUNG)
    return cls(config, ladder)
