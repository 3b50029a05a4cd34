"""The executor's two lanes and the partition rungs they run on (SMs on a GPU, cores on a CPU)."""

from __future__ import annotations

import enum

from agentserve.protocol.base import WireStruct


class Lane(enum.IntEnum):
    DECODE = 0
    PREFILL = 1


CPU_CORES_BACKEND = "cpu-cores"  # the partition backend whose units are CPU cores (every other one: SMs)


def backend_unit(backend: str) -> str:
    """What a partition backend's rungs count: ``cores`` (the CPU backend) or ``SMs``."""
    return "cores" if backend == CPU_CORES_BACKEND else "SMs"


class Rung(WireStruct):
    """One partition of the ladder: units are SMs on a GPU, cores on a CPU."""

    index: int
    decode_units: int
    prefill_units: int
    partitioned: bool


