"""Partition backends: how the decode and prefill lanes split the hardware (BRIEF §4)."""

from agentserve.executor.partition.base import (
    BackendUnavailable,
    LaneBinding,
    PartitionBackend,
    PartitionBusy,
)
from agentserve.executor.partition.detect import ORDER, detect
from agentserve.executor.partition.ladder import (
    Granularity,
    build_ladder,
    granularity_from_cc,
    rung_for_decode_units,
)

__all__ = [
    "ORDER",
    "BackendUnavailable",
    "Granularity",
    "LaneBinding",
    "PartitionBackend",
    "PartitionBusy",
    "build_ladder",
    "detect",
    "granularity_from_cc",
    "rung_for_decode_units",
]
