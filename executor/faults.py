"""Sticky CUDA errors: faults after which the process's CUDA context is unusable.

An illegal address, a device-side assert, a launch failure (and a few more, listed in the CUDA runtime's
error notes as leaving the context "in an inconsistent state") make every later CUDA call in the process
fail.  A lane that went on would fail every step, or worse, return garbage from a half-finished one, so
the executor treats them as the end of the process: it reports a fatal ``ExecError`` and exits, and the
orchestrator's restart path brings up a fresh executor.  Every other step error (bad input, out of
memory) stays a step failure.
"""

from __future__ import annotations

# cudaError / CUresult codes of sticky errors (the runtime and driver number them alike).
STICKY_CODES = {
    214: "uncorrectable ECC error",
    700: "illegal address",
    702: "launch timeout",
    710: "device-side assert",
    714: "hardware stack error",
    715: "illegal instruction",
    716: "misaligned address",
    717: "invalid address space",
    718: "invalid program counter",
    719: "launch failure",
}

# How PyTorch and the driver spell them in messages (``torch.AcceleratorError``, ``RuntimeError``).
STICKY_TEXT = (
    "illegal memory access",
    "device-side assert",
    "unspecified launch failure",
    "misaligned address",
    "illegal instruction",
    "hardware stack error",
    "invalid program counter",
    "uncorrectable ecc error",
    "cuda_error_illegal_address",
    "cuda_error_assert",
    "cuda_error_launch_failed",
    "cudaerrorillegaladdress",
    "cudaerrorassert",
    "cudaerrorlaunchfailure",
)


class DeviceFault(RuntimeError):
    """A sticky CUDA error poisoned this process's context; the executor must exit.

    ``reported``: the fatal ``ExecError`` already went out (with the step that failed)."""

    reported: bool = False


def _code(error: BaseException) -> int | None:
    for name in ("error_code", "code"):
        value = getattr(error, name, None)
        if isinstance(value, int):
            return value
    return None


def is_sticky_cuda_error(error: BaseException) -> bool:
    """Whether ``error`` (or an exception it was raised from) is a sticky CUDA error."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, DeviceFault) or _code(current) in STICKY_CODES:
            return True
        text = str(current).lower()
        if any(marker in text for marker in STICKY_TEXT):
            return True
        current = current.__cause__ or current.__context__
    return False


class WarmUpFailed(RuntimeError):
    """A (rung, lane) failed its start-up step with an error that did not poison the context.

    Seen on an H200 (driver 580, torch 2.11): small bf16 matrix products failed on the prefill lane's green
    context (``CUBLAS_STATUS_EXECUTION_FAILED``) while fp32, plain streams and large products ran.  A rung
    that fails so leaves the ladder; this is raised when the top rung or every partitioned one failed, and the
    executor then falls back from green contexts to plain streams rather than failing to start."""
