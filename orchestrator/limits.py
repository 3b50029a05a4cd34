"""Serving limits from ``configs/limits.toml``: request bounds, slow-client rules, the executor hang and load bounds.

``[request]`` becomes :class:`agentserve.protocol.limits.Limits` (the contract the gateway shares);
``[clients]`` and ``[executor]`` are the orchestrator's own.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from agentserve import configs
from agentserve.configs import ConfigError
from agentserve.protocol.limits import Limits


@dataclass(frozen=True, slots=True)
class ClientRules:
    send_hwm: int = 64
    stall_timeout_s: float = 3.0
    max_backlog_events: int = 100_000
    heartbeat_ms: int = 1000
    heartbeat_timeout_ms: int = 3000
    probe_interval_s: float = 1.0
    tokenize_inline_bytes: int = 65536
    max_sessions: int = 16384
    max_tokenizing_bytes: int = 64 * 2**20


@dataclass(frozen=True, slots=True)
class HangRule:
    hang_floor_s: float = 10.0
    hang_step_multiple: float = 20.0
    load_timeout_s: float = 600.0  # an executor not ready this long after its start failed to start

    def bound_s(self, slowest_step_s: float) -> float:
        """How long plans may be in flight with no result before the executor counts as hung."""
        return max(self.hang_floor_s, self.hang_step_multiple * slowest_step_s)


@dataclass(frozen=True, slots=True)
class ServingLimits:
    request: Limits = field(default_factory=Limits)
    clients: ClientRules = field(default_factory=ClientRules)
    executor: HangRule = field(default_factory=HangRule)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ServingLimits:
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigError(f"unknown limits sections: {sorted(unknown)}")
        request_data = configs.check_fields(Limits, "request", data.get("request", {}))
        clients = ClientRules(**configs.check_fields(ClientRules, "clients", data.get("clients", {})))
        executor = HangRule(**configs.check_fields(HangRule, "executor", data.get("executor", {})))
        try:
            request = Limits.from_dict(request_data)
        except ValueError as e:
            raise ConfigError(f"limits: {e}") from None
        numbers = [*dataclasses.astuple(clients), *dataclasses.astuple(executor)]
        if not all(v > 0 for v in numbers):
            raise ConfigError("limits: every [clients] and [executor] value must be > 0")
        return cls(request, clients, executor)


def load_limits(
    user_file: str | os.PathLike[str] | None = None, environ: dict[str, str] | None = None
) -> ServingLimits:
    """Packaged ``limits.toml``, then a user file's ``[request]``/``[clients]``/``[executor]``, then variables."""
    merged = configs.packaged("limits")
    if user_file is not None:
        user = configs.read_user_file(user_file)
        merged = configs.merge(merged, {k: v for k, v in user.items() if k in merged})
    return ServingLimits.from_dict(configs.env_overrides(merged, environ))
