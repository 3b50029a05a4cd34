"""A realistic snapshot: 4 agents in every phase on a partitioned GPU under load."""

from __future__ import annotations

from agentserve.protocol.stats import (
    Control,
    Kv,
    LaneStat,
    Latency,
    Partition,
    Queues,
    Server,
    SessionRow,
    SessionState,
    Snapshot,
)


def realistic(n_sessions: int = 6) -> Snapshot:
    states = list(SessionState)
    rows = [
        SessionRow(
            id=i + 1,
            name=f"react-agent-{i + 1}",
            state=states[i % len(states)],
            turn=1 + i % 4,
            context_tokens=3100 + 137 * i,
            turn_tokens=17 * i,
            last_ttft_ms=180.0 + 40 * i,
            last_tpot_ms=38.0 + 9 * i,
        )
        for i in range(n_sessions)
    ]
    return Snapshot(
        seq=812,
        t_wall=1.7e9,
        server=Server(
            pid=4242,
            endpoint="ipc:///run/user/1000/agentserve-default.sock",
            run="default",
            model="Qwen2.5-0.5B-Instruct",
            device="NVIDIA RTX 4090",
            uptime_s=3725.0,
        ),  # fmt: skip
        partition=Partition(
            rung=3,
            num_rungs=10,
            decode_units=52,
            prefill_units=76,
            total_units=128,
            unit="SM",
            partitioned=True,
            backend="green_ctx",
            reason="CUDA 12.4+ green contexts",
        ),  # fmt: skip
        control=Control(
            policy="agentserve",
            b_prefill=256,
            b_prefill_max=1024,
            r_min=52,
            tpot_low_ms=40.0,
            tpot_high_ms=60.0,
            adjustments=17,
        ),  # fmt: skip
        tpot=Latency(
            p50_ms=41.5,
            p95_ms=63.2,
            last_ms=44.0,
            slo_ms=50.0,
            history_ms=[30, 35, 41, 48, 52, 61, 70, 55, 47, 42, 39, 44] * 3,
        ),  # fmt: skip
        ttft=Latency(
            p50_ms=212.0,
            p95_ms=640.0,
            last_ms=250.0,
            slo_ms=1000.0,
            history_ms=[150, 220, 480, 900, 1200, 640, 300, 210],
        ),  # fmt: skip
        queues=Queues(cold=2, resume=1, decode=4),
        kv=Kv(used_blocks=1830, total_blocks=4096, pinned_blocks=412, block_size=16, prefix_hit_rate=0.73),
        lanes=[
            LaneStat(name="decode", utilisation=0.88, steps=51234, last_step_ms=41.0, tokens_per_s=96.0),
            LaneStat(name="prefill", utilisation=0.42, steps=812, last_step_ms=180.0, tokens_per_s=5300.0),
        ],
        sessions=rows,
        turns_done=311,
        tokens_out=40211,
        tokens_per_s=96.0,
    )
