"""The decoder's weight matrices and the matmul that applies them.

- :class:`DenseLinear`: the weight in the model dtype, applied with ``F.linear`` (CUDA; CPUs with native
  bf16; fp32 checkpoints by default).
- :class:`PackedFp16Linear`: the weight packed once into FBGEMM's fp16 layout and applied to fp32
  activations with fp32 accumulation (``quantized::linear_dynamic_fp16``, the kernel behind PyTorch's
  dynamic fp16 quantization).  Half the bytes of fp32 and a kernel built for the few-row products of
  decode: on 2 AVX2 cores a ``bench``-model decode step of 4 sequences at 3k context takes about 0.7x the
  time of ``F.linear`` on fp32 weights, the lm_head product ~4x less.

Which one a matrix gets (:func:`choose_format`) under the ``weights`` setting: ``dense`` always dense;
``fp16`` packs every matrix; ``auto`` packs on a CPU running fp32 when the checkpoint stored the matrix in
16 bits and every value is within fp16's range.  That loses nothing but fp16 subnormals: a bf16 value
(8 significant bits) of magnitude 2^-14 .. 65504 is exactly an fp16 (11 significant bits); below 2^-14 it
rounds by at most 2^-25.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch
import torch.nn.functional as F

from agentserve.executor.errors import EngineError

WEIGHTS_SETTINGS = ("auto", "dense", "fp16")  # what a user asks for; a matrix ends up dense or fp16
FP16_MAX = 65504.0


class Linear(Protocol):
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    @property
    def nbytes(self) -> int:
        """Bytes of weight (and bias) a product streams."""
        ...


class DenseLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.weight, self.bias) if t is not None)


class PackedFp16Linear:
    """``x @ weight.T + bias`` for fp32 ``x`` with ``weight`` held as packed fp16 (x86 CPUs, FBGEMM)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        b = None if bias is None else bias.float()
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.float(), b)
        self._nbytes = weight.numel() * 2 + (0 if b is None else b.numel() * 4)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)

    @property
    def nbytes(self) -> int:
        return self._nbytes


@functools.cache
def fp16_packing_available() -> bool:
    """True when this PyTorch has FBGEMM's fp16 linear (x86-64 builds) and it runs on this CPU."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    try:
        w = torch.ops.quantized.linear_prepack_fp16(torch.ones(8, 8), None)
        return bool(torch.ops.quantized.linear_dynamic_fp16(torch.ones(2, 8), w).sum().item() == 128.0)
    except RuntimeError:
        return False


def _known(weights: str) -> None:
    if weights not in WEIGHTS_SETTINGS:
        raise EngineError(f"unknown weights setting {weights!r}; use {', '.join(WEIGHTS_SETTINGS)}")


def check_weights(weights: str, device: torch.device, dtype: torch.dtype) -> None:
    """Fail early for a ``weights`` setting this device, dtype or build cannot run."""
    _known(weights)
    if weights != "fp16":
        return
    if device.type != "cpu" or dtype != torch.float32:
        raise EngineError(f"weights fp16 (packed for FBGEMM) needs device cpu and dtype float32, "
                          f"not {device.type} {str(dtype).removeprefix('torch.')}")
    if not fp16_packing_available():
        raise EngineError("weights fp16 needs FBGEMM (an x86-64 PyTorch build on an AVX2 CPU); use dense")


def choose_format(weights: str, stored: torch.dtype, weight: torch.Tensor) -> str:
    """``dense`` or ``fp16`` for one matrix, ``weight`` in the model dtype, ``stored`` its checkpoint dtype."""
    _known(weights)
    if weights != "auto":
        return weights
    cpu_fp32 = weight.device.type == "cpu" and weight.dtype == torch.float32
    if not cpu_fp32 or stored.itemsize != 2 or not fp16_packing_available():
        return "dense"
    lo, hi = torch.aminmax(weight)
    return "dense" if max(-lo.item(), hi.item()) > FP16_MAX else "fp16"


def make_linear(fmt: str, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    """A matrix in the format :func:`choose_format` picked; tensors already in the model dtype."""
    return PackedFp16Linear(weight, bias) if fmt == "fp16" else DenseLinear(weight, bias)
