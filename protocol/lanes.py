"""The executor's two lanes and the partition rungs they run on (SMs on a GPU, cores on a CPU)."""

from __future__ import annotations

import enum
from collections.abc import Mapping

from agentserve.protocol.base import WireStruct


class Lane(enum.IntEnum):
    DECODE = 0
    PREFILL = 1


CPU_CORES_BACKEND = "cpu-cores"  # the partition backend whose units are CPU cores (every other one: SMs)

# OpenMP's binding settings.  With any of them set, the OpenMP runtime pins the process's first thread to one place
# as it loads (when PyTorch is imported), and the cpu-cores backend, which takes the usable cores from that
# thread's mask, would see one core: no partition at all.  The executor pins its lane threads and their OpenMP
# workers itself, so `agentserve up` starts it without them.
OPENMP_BINDING_ENV = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY")


def openmp_binding(environ: Mapping[str, str]) -> list[str]:
    """The settings of ``environ`` that make OpenMP pin threads, as ``NAME=value``: none where ``OMP_PROC_BIND`` is
    false (binding off, whatever the others say)."""
    if environ.get("OMP_PROC_BIND", "").strip().lower() == "false":
        return []
    return [f"{k}={environ[k]}" for k in OPENMP_BINDING_ENV if k in environ]


# How long an idle OpenMP worker spins before it sleeps: libgomp's GOMP_SPINCOUNT, iterations of a pause loop, read as
# the runtime loads.  Its default (300,000) is ~7 ms on Zen 5.  On a CPU box the lanes share few cores with the
# orchestrator and the clients, and a thread that spins that long holds a core another needs: a lane's new worker,
# started on the core of the thread that creates it, spun at its first barrier while that thread waited its turn
# to reach it, and a two-thread step lost 1-8 ms before both cores worked (seen in a server's scheduler trace).
# 20,000 (~0.5 ms here) still spins through the gaps between a step's operations.  `agentserve up` starts the
# executor with it unless the environment sets GOMP_SPINCOUNT or OMP_WAIT_POLICY.
OPENMP_SPIN_COUNT = "20000"


def openmp_wait_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """What the executor's environment adds to ``environ``: the spin count above, where it sets no wait policy."""
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return {}
    return {"GOMP_SPINCOUNT": OPENMP_SPIN_COUNT}


def backend_unit(backend: str) -> str:
    """What a partition backend's rungs count: ``cores`` (the CPU backend) or ``SMs``."""
    return "cores" if backend == CPU_CORES_BACKEND else "SMs"


class Rung(WireStruct):
    """One partition of the ladder: units are SMs on a GPU, cores on a CPU."""

    index: int
    decode_units: int
    prefill_units: int
    partitioned: bool


