"""``cuda-streams`` backend: CUDA without green contexts — two streams, decode at high priority.

Nothing is partitioned: both lanes see every SM; the stream priority only makes the block
scheduler prefer decode's blocks when both are queued.  One rung.  The device is ``cuda.index``; each
lane thread makes it current when it binds (:class:`StreamBackend`).
"""

from __future__ import annotations

from agentserve.executor.partition.base import BackendUnavailable
from agentserve.executor.partition.streams import StreamBackend
from agentserve.executor.partition.torch_cuda import TorchCuda
from agentserve.protocol.lanes import Lane, Rung


class CudaStreamsBackend(StreamBackend):
    name = "cuda-streams"
    unit = "SMs"

    def __init__(self, cuda: TorchCuda) -> None:
        why_not = cuda.unavailable_reason()
        if why_not:
            raise BackendUnavailable(why_not)
        cuda.init()
        total = cuda.sm_count()
        high = cuda.high_priority()
        self._cuda = cuda
        self._streams = {0: {Lane.DECODE: cuda.plain_stream(high), Lane.PREFILL: cuda.plain_stream(0)}}
        reason = f"two CUDA streams (decode priority {high}, prefill 0); not partitioned"
        super().__init__([Rung(0, total, total, False)], f"cuda:{cuda.index} {cuda.device_name()}", reason)

    def _release(self) -> None:
        for stream in self._streams.get(0, {}).values():
            self._cuda.synchronize(stream)
        self._streams.clear()
