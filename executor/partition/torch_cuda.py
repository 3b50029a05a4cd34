"""The few ``torch.cuda`` calls the GPU backends make, behind one small seam that tests replace."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch


def device_index(device: str | torch.device) -> int:
    """The CUDA device index of ``cuda:N`` (``N``), ``cuda`` (the current device) or anything else (0)."""
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if dev.type != "cuda":
        return 0
    if dev.index is not None:
        return dev.index
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


class TorchCuda:
    """torch.cuda for one device: availability, plain and external streams, stream binding."""

    def __init__(self, device_index: int = 0) -> None:
        self.index = device_index

    def unavailable_reason(self) -> str | None:
        """``None`` when CUDA can run here, else why not."""
        if torch.version.cuda is None:
            return f"torch {torch.__version__} is a CPU build (torch.version.cuda is None)"
        if not torch.cuda.is_available():
            return f"torch.cuda.is_available() is False (torch {torch.__version__}, CUDA {torch.version.cuda})"
        if self.index >= torch.cuda.device_count():
            return f"no CUDA device {self.index} (device_count {torch.cuda.device_count()})"
        return None

    def init(self) -> None:
        """Initialise torch's CUDA state and make this device current on the calling thread."""
        torch.cuda.init()
        self.set_device()

    def ensure_context(self) -> None:
        """Create the device's primary context (green contexts must come after it).

        ``torch.cuda.set_device`` skips ``cudaSetDevice`` when the device is already current, so it
        does not create the context; a device-wide synchronise is a runtime call that does."""
        self.init()
        torch.cuda.synchronize(self.index)

    def set_device(self) -> None:
        """Make this device current on the calling thread (each new thread starts on device 0)."""
        torch.cuda.set_device(self.index)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.index)

    def sm_count(self) -> int:
        return torch.cuda.get_device_properties(self.index).multi_processor_count

    def capability(self) -> tuple[int, int]:
        return torch.cuda.get_device_capability(self.index)

    def high_priority(self) -> int:
        """The highest stream priority (lowest number); 0 if the device has no range."""
        low, high = torch.cuda.Stream.priority_range()
        return min(low, high)

    def plain_stream(self, priority: int = 0) -> Any:
        return torch.cuda.Stream(device=self.index, priority=priority)

    def external_stream(self, handle: Any) -> Any:
        return torch.cuda.ExternalStream(int(handle), device=torch.device("cuda", self.index))

    def use(self, stream: Any) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def synchronize(self, stream: Any) -> None:
        stream.synchronize()

    def synchronize_device(self) -> None:
        """Wait for all work on the device (every stream of every context)."""
        torch.cuda.synchronize(self.index)
