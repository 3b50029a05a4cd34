"""Shared lane binding of the GPU backends: a lane thread makes its device current, then its stream."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from agentserve.executor.partition.base import LaneBinding, PartitionBackend
from agentserve.executor.partition.torch_cuda import TorchCuda
from agentserve.protocol.lanes import Lane, Rung


class StreamBackend(PartitionBackend):
    """Subclasses fill ``_streams[rung index][lane]`` with torch streams before ``__init__`` returns.

    Binding sets the backend's device on the lane thread first: a new thread starts on device 0, and
    kernels launched by libraries that read the current device (Triton, CUDA graphs) would otherwise
    go to device 0 with another device's pointers."""

    _cuda: TorchCuda
    _streams: dict[int, dict[Lane, Any]]

    def stream_for(self, lane: Lane, rung: int) -> Any:
        """The torch stream ``lane`` runs on at rung ``rung`` (for measurements; lanes bind instead)."""
        return self._streams[self.rung(rung).index][Lane(lane)]

    def _renumber(self, new_index: dict[int, int]) -> None:
        """A dropped rung's streams leave the map; they are destroyed with the rest at ``close``."""
        self._streams = {new_index[i]: lanes for i, lanes in self._streams.items() if i in new_index}

    @contextmanager
    def _bind(self, lane: Lane, rung: Rung) -> Iterator[LaneBinding]:
        stream = self._streams[rung.index][lane]
        units = rung.decode_units if lane == Lane.DECODE else rung.prefill_units
        self._cuda.set_device()
        with self._cuda.use(stream):
            yield LaneBinding(lane=lane, rung=rung, units=units, stream=stream)
