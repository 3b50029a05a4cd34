"""Typed scheduler configuration, read from ``configs/policy.toml`` and ``configs/slo.toml``.

Every constant the scheduler, the KV retention and the TPOT controller use lives in those two
files; this module only gives them types and checks their ranges.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from agentserve import configs
from agentserve.configs import ConfigError

PREFILL_LANE_RESUMES = ("first", "idle", "never")  # when AgentServe's prefill lane takes resumes
BY_DEVICE = ("auto", "always", "never")  # switches whose right value depends on the device: auto = on SMs only


def allowed_here(setting: str, unit: str) -> bool:
    """A :data:`BY_DEVICE` setting on a device whose rungs count ``unit``: ``auto`` allows on SMs (a GPU) only.

    Used for the moves measured to cost on CPU cores: decode on the full rung beside prefill (measured with
    the prefill lane at ``SCHED_IDLE``; it also turns the core loan off) and shrinking the resume budget (a
    prefill token costs the same in any decode step of one core); docs/scheduler.md has the figures."""
    return setting == "always" or (setting == "auto" and unit == "SMs")


@dataclass(frozen=True, slots=True)
class SchedCfg:
    policy: str = "agentserve"
    cold_threshold_tokens: int = 512
    max_batch_seqs: int = 256
    cold_chunk_tokens: int = 256
    max_prefill_seqs: int = 8
    decode_full_rung_when_idle: str = "auto"
    decode_lookahead: int = 1
    prefill_lane_resumes: str = "first"
    resume_ride_after_ms: float = 150.0
    preempt_cold_chunks: bool = True
    prefill_borrows_decode_cores: bool = True
    resume_hold_max_tokens: int = 128


@dataclass(frozen=True, slots=True)
class KvCfg:
    retain_on_tool_call: bool = True
    ttl_default_s: float = 5.0
    ttl_min_s: float = 0.5
    ttl_cap_s: float = 60.0
    ttl_quantile: float = 0.9
    ttl_margin: float = 1.25
    ttl_min_samples: int = 2
    turn_end_grace_s: float = 2.0


@dataclass(frozen=True, slots=True)
class ControllerCfg:
    b_prefill_init: int = 256
    b_prefill_min: int = 16
    b_prefill_max: int = 1024
    b_prefill_add: int = 32
    b_prefill_mult: float = 0.5
    r_min_init_share: float = 0.5
    r_min_lo_share: float = 0.2
    r_min_hi_share: float = 1.0
    full_rung_on_top: str = "auto"
    shrink_b_prefill: str = "auto"
    period_s: float = 0.25
    window_s: float = 1.0
    min_samples: int = 8
    cooldown_periods: int = 1
    probe_hold_periods: int = 8


@dataclass(frozen=True, slots=True)
class GuardCfg:
    starvation_s: float = 2.0
    min_tokens: int = 128
    min_prefill_share: float = 0.3


@dataclass(frozen=True, slots=True)
class FcfsCfg:
    max_batch_tokens: int = 16384


@dataclass(frozen=True, slots=True)
class ChunkedCfg:
    token_budget: int = 512


@dataclass(frozen=True, slots=True)
class LlamaCppCfg:
    n_batch: int = 2048
    n_slots: int = 8


@dataclass(frozen=True, slots=True)
class SloCfg:
    tpot_target_ms: float = 50.0
    ttft_target_ms: float = 2000.0
    tpot_quantile: float = 0.9
    theta_low: float = 0.7
    theta_high: float = 0.95


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    scheduler: SchedCfg = field(default_factory=SchedCfg)
    kv: KvCfg = field(default_factory=KvCfg)
    controller: ControllerCfg = field(default_factory=ControllerCfg)
    guard: GuardCfg = field(default_factory=GuardCfg)
    fcfs: FcfsCfg = field(default_factory=FcfsCfg)
    chunked: ChunkedCfg = field(default_factory=ChunkedCfg)
    llamacpp: LlamaCppCfg = field(default_factory=LlamaCppCfg)
    slo: SloCfg = field(default_factory=SloCfg)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SchedulerConfig:
        """Build from a merged ``policy.toml`` + ``slo.toml`` dict; unknown keys and wrong types are errors."""
        fields = dataclasses.fields(cls)
        unknown = set(data) - {f.name for f in fields}
        if unknown:
            raise ConfigError(f"unknown scheduler config sections: {sorted(unknown)}")
        kwargs = {}
        for f in fields:
            make = f.default_factory  # the section's dataclass
            kwargs[f.name] = make(**configs.check_fields(make, f.name, data.get(f.name, {})))  # type: ignore[operator]
        config = cls(**kwargs)
        config.validate()
        return config

    def with_policy(self, name: str) -> SchedulerConfig:
        return dataclasses.replace(self, scheduler=dataclasses.replace(self.scheduler, policy=name))

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first value out of range."""
        c, s, k = self.controller, self.slo, self.kv
        checks = [
            (0 < c.b_prefill_min <= c.b_prefill_init <= c.b_prefill_max, "b_prefill_min <= init <= max"),
            (0.0 < c.b_prefill_mult < 1.0, "b_prefill_mult in (0, 1)"),
            (c.b_prefill_add > 0, "b_prefill_add > 0"),
            (0.0 <= c.r_min_lo_share <= c.r_min_hi_share <= 1.0, "r_min_lo_share <= r_min_hi_share"),
            (c.period_s > 0 and c.window_s > 0, "period_s, window_s > 0"),
            (0.0 < s.theta_low < s.theta_high, "0 < theta_low < theta_high"),
            (s.tpot_target_ms > 0, "tpot_target_ms > 0"),
            (0.0 < s.tpot_quantile <= 1.0, "tpot_quantile in (0, 1]"),
            (0.0 < k.ttl_min_s <= k.ttl_default_s <= k.ttl_cap_s, "ttl_min_s <= ttl_default_s <= ttl_cap_s"),
            (self.scheduler.cold_chunk_tokens > 0, "cold_chunk_tokens > 0"),
            (self.scheduler.max_batch_seqs > 0, "max_batch_seqs > 0"),
            (0 <= self.scheduler.decode_lookahead <= 4, "decode_lookahead in [0, 4]"),
            (self.scheduler.prefill_lane_resumes in PREFILL_LANE_RESUMES,
             f"prefill_lane_resumes in {PREFILL_LANE_RESUMES}"),
            (self.scheduler.resume_ride_after_ms >= 0, "resume_ride_after_ms >= 0"),
            (self.scheduler.decode_full_rung_when_idle in BY_DEVICE,
             f"decode_full_rung_when_idle in {BY_DEVICE}"),
            (c.full_rung_on_top in BY_DEVICE, f"full_rung_on_top in {BY_DEVICE}"),
            (c.shrink_b_prefill in BY_DEVICE, f"shrink_b_prefill in {BY_DEVICE}"),
            (self.chunked.token_budget > 0 and self.llamacpp.n_batch > 0, "token budgets > 0"),
            (self.llamacpp.n_slots > 0, "n_slots > 0"),
        ]
        for ok, what in checks:
            if not ok:
                raise ConfigError(f"scheduler config: need {what}")


def load_config(
    user_file: str | os.PathLike[str] | None = None,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> SchedulerConfig:
    """Packaged ``policy`` + ``slo`` files, then a user file, ``AGENTSERVE_*`` variables, overrides."""
    merged = configs.merge(configs.packaged("policy"), configs.packaged("slo"))
    if user_file is not None:
        merged = configs.merge(merged, configs.read_user_file(user_file))
    merged = configs.env_overrides(merged, environ)
    if overrides:
        merged = configs.merge(merged, overrides)
    known = {f.name for f in dataclasses.fields(SchedulerConfig)}
    return SchedulerConfig.from_dict({k: v for k, v in merged.items() if k in known})
