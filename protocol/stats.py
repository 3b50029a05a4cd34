"""The stats snapshot: what the orchestrator publishes for `agentserve top`.

The stats board (``shm/board.py``) and ``GetStats`` over the wire carry it as opaque bytes:
``encode_snapshot`` / ``decode_snapshot``.  The encoding is a msgpack *map*, so a reader ignores
fields it does not know and defaults fields it lacks; ``SNAPSHOT_VERSION`` changes only when a
field changes meaning.  Times are milliseconds, ratios are 0..1, histories are oldest first.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

SNAPSHOT_VERSION = 1


class SessionState(enum.StrEnum):
    QUEUED = "queued"  # a turn is waiting for its first prefill step
    PREFILLING = "prefilling"
    DECODING = "decoding"
    IN_TOOL = "in_tool"  # the last turn ended in tool calls; KV kept for the resume
    IDLE = "idle"


class _S(msgspec.Struct, kw_only=True):
    pass


class Latency(_S):
    """One latency metric over the recent window, against its SLO."""

    p50_ms: float = 0.0
    p95_ms: float = 0.0
    last_ms: float = 0.0
    slo_ms: float = 0.0  # 0: no SLO set
    history_ms: list[float] = []  # recent per-interval p50s, oldest first (sparkline)


class Partition(_S):
    """The partition the decode lane runs on right now (units: SMs on a GPU, cores on a CPU)."""

    rung: int = 0
    num_rungs: int = 1
    decode_units: int = 0
    prefill_units: int = 0
    total_units: int = 0
    unit: str = "SM"
    partitioned: bool = False
    backend: str = ""  # e.g. green_ctx, mps, none-cpu
    reason: str = ""  # why this backend (e.g. "no CUDA: one shared core set")


class Control(_S):
    """The scheduler's feedback state."""

    policy: str = ""
    b_prefill: int = 0  # resume-prefill token budget per step
    b_prefill_max: int = 0
    r_min: int = 0  # decode unit reserve
    tpot_low_ms: float = 0.0  # hysteresis band
    tpot_high_ms: float = 0.0
    adjustments: int = 0  # feedback moves so far


class Queues(_S):
    cold: int = 0
    resume: int = 0
    decode: int = 0


class Kv(_S):
    used_blocks: int = 0
    total_blocks: int = 0
    pinned_blocks: int = 0  # distinct blocks held for sessions between turns (a tool call, its grace)
    block_size: int = 0
    prefix_hit_rate: float = 0.0  # cached / prompt tokens over the window
    # Since the scheduler started (an executor restart starts a new one): requests preempted (their blocks freed,
    # recomputed later), cached prefix blocks evicted for new ones, sessions' pinned tables broken for room.
    preemptions: int = 0
    evictions: int = 0
    pins_broken: int = 0


class LaneStat(_S):
    name: str  # decode | prefill
    utilisation: float = 0.0  # busy share of wall time over the window
    steps: int = 0
    last_step_ms: float = 0.0
    tokens_per_s: float = 0.0
    gap_p50_ms: float = 0.0  # the lane's idle time between consecutive steps (median over the window)


class SessionRow(_S):
    id: int
    name: str = ""
    state: SessionState = SessionState.IDLE
    turn: int = 0  # turns started
    context_tokens: int = 0
    turn_tokens: int = 0  # tokens generated in the current / last turn
    last_ttft_ms: float = 0.0
    last_tpot_ms: float = 0.0


class Server(_S):
    pid: int = 0
    endpoint: str = ""
    run: str = ""
    model: str = ""
    device: str = ""
    started_wall: float = 0.0
    uptime_s: float = 0.0
    http: str = ""  # the HTTP gateway's URL (`up --http`; empty: none)


class Snapshot(_S):
    version: int = SNAPSHOT_VERSION
    seq: int = 0  # publish counter
    t_wall: float = 0.0
    server: Server = msgspec.field(default_factory=Server)
    partition: Partition = msgspec.field(default_factory=Partition)
    control: Control = msgspec.field(default_factory=Control)
    tpot: Latency = msgspec.field(default_factory=Latency)
    ttft: Latency = msgspec.field(default_factory=Latency)
    queues: Queues = msgspec.field(default_factory=Queues)
    kv: Kv = msgspec.field(default_factory=Kv)
    lanes: list[LaneStat] = []
    sessions: list[SessionRow] = []  # the stats board may list fewer (the busiest first): see sessions_total
    sessions_total: int = 0  # sessions open, listed or not
    turns_done: int = 0
    tokens_out: int = 0
    tokens_per_s: float = 0.0
    restarting: bool = False  # the executor is being restarted after a crash (turns are refused)


class SnapshotError(ValueError):
    """Bytes that are not a snapshot this reader understands."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Snapshot)


def encode_snapshot(snapshot: Snapshot) -> bytes:
    return _encoder.encode(snapshot)


def decode_snapshot(data: bytes | memoryview) -> Snapshot:
    try:
        snap = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise SnapshotError(f"not a stats snapshot: {e}") from None
    if snap.version != SNAPSHOT_VERSION:
        raise SnapshotError(f"snapshot version {snap.version}, this reader knows {SNAPSHOT_VERSION}")
    return snap


def to_json_obj(snapshot: Snapshot) -> dict[str, Any]:
    """A plain dict (all fields, defaults included) for ``agentserve top --once --json``."""
    return msgspec.to_builtins(snapshot)
