"""``green-ctx`` through ``torch.cuda.green_contexts`` (torch >= 2.10), used when cuda-bindings is not.

torch creates one green context per ``GreenContext.create(num_sms=...)`` call, so the decode and
prefill contexts come from *separate* splits: the driver does not promise they are disjoint.  The
granularity is the documented compute-capability table (torch does not expose the SM resource).
Both facts are stated in the backend's reason.
"""

from __future__ import annotations

from typing import Any

from agentserve.executor.partition.base import BackendUnavailable
from agentserve.executor.partition.ladder import DEFAULT_SHARES, build_ladder, granularity_from_cc
from agentserve.executor.partition.streams import StreamBackend
from agentserve.executor.partition.torch_cuda import TorchCuda
from agentserve.protocol.lanes import Lane, Rung


def _green_context_class() -> Any:
    try:
        from torch.cuda.green_contexts import GreenContext
    except ImportError as e:
        raise BackendUnavailable(f"torch.cuda.green_contexts is missing ({e})") from e
    return GreenContext


class TorchGreenCtxBackend(StreamBackend):
    name = "green-ctx"
    unit = "SMs"

    def __init__(self, cuda: TorchCuda, shares: tuple[float, ...] = DEFAULT_SHARES) -> None:
        green = _green_context_class()
        self._cuda = cuda
        self._contexts: list[Any] = []
        self._streams: dict[int, dict[Lane, Any]] = {}
        try:
            ladder, reason = self._build(green, shares)
        except Exception as e:  # a CPU build raises RuntimeError from GreenContext.create
            self._release()
            raise BackendUnavailable(f"torch GreenContext raised {type(e).__name__}: {e}") from e
        super().__init__(ladder, f"cuda:{cuda.index} {cuda.device_name()}", reason)

    def _build(self, green: Any, shares: tuple[float, ...]) -> tuple[list[Rung], str]:
        import torch

        cuda = self._cuda
        if not getattr(torch.cuda.green_contexts, "SUPPORTED", True):
            green.create(num_sms=1, device_id=cuda.index)  # raises its own "not built with" error
        major, minor = torch.cuda.get_device_capability(cuda.index)
        total = cuda.sm_count()
        gran = granularity_from_cc(major, minor)
        ladder = build_ladder(total, gran, shares)
        for rung in ladder:
            if rung.partitioned:
                self._streams[rung.index] = {
                    Lane.DECODE: self._stream(green, rung.decode_units, cuda.index),
                    Lane.PREFILL: self._stream(green, rung.prefill_units, cuda.index),
                }
            else:
                self._streams[rung.index] = {
                    Lane.DECODE: cuda.plain_stream(cuda.high_priority()),
                    Lane.PREFILL: cuda.plain_stream(0),
                }
        reason = (
            f"torch.cuda.green_contexts: {total} SMs, CC {major}.{minor} granularity min {gran.min_size} "
            f"align {gran.align} (table, not queried); decode/prefill SM sets come from separate splits "
            "and may overlap"
        )
        return ladder, reason

    def _stream(self, green: Any, sms: int, device: int) -> Any:
        ctx = green.create(num_sms=sms, device_id=device)
        self._contexts.append(ctx)
        return ctx.Stream()

    def _release(self) -> None:
        for lanes in self._streams.values():
            for stream in lanes.values():
                stream.synchronize()
        self._streams.clear()  # streams before contexts
        self._contexts.clear()
