"""The decoder's weight matrices and the matmul that applies them.

- :class:`DenseLinear`: the weight in the model dtype, applied with ``F.linear`` (CUDA; CPUs with native
  bf16; fp32 checkpoints by default).
- :class:`PackedFp16Linear`: the weight packed once into FBGEMM's fp16 layout and applied to fp32
  activations with fp32 accumulation (``quantized::linear_dynamic_fp16``, the kernel behind PyTorch's
  dynamic fp16 quantization).  Half the bytes of fp32 and a kernel built for the few-row products of decode.
- :class:`HybridLinear` (CPUs with native bf16 dot products): the packed fp16 matrix for products of at
  most ``HYBRID_ROWS`` rows (decode: exact, as above) and the checkpoint's bf16 matrix for longer ones
  (prefill: the activations are rounded to bf16 for the product, which oneDNN runs on the CPU's bf16
  units with fp32 accumulation; the result is fp32 again).  Twice the weight memory of either alone.

Which one a matrix gets (:func:`choose_format`) under the ``weights`` setting: ``dense`` always dense;
``fp16`` packs every matrix; ``hybrid`` makes every matrix hybrid; ``auto``, on a CPU running fp32 when the
checkpoint stored the matrix in 16 bits and every value is within fp16's range, packs it — as a hybrid
where the CPU has native bf16 and the checkpoint stored bf16, else fp16 only.  Packing loses nothing but
fp16 subnormals: a bf16 value (8 significant bits) of magnitude 2^-14 .. 65504 is exactly an fp16 (11
significant bits); below 2^-14 it rounds by at most 2^-25.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch
import torch.nn.functional as F

from agentserve.executor.errors import EngineError

WEIGHTS_SETTINGS = ("auto", "dense", "fp16", "hybrid")  # what a user asks for; a matrix ends up as one of the rest
FP16_MAX = 65504.0
HYBRID_ROWS = 32  # a hybrid matrix runs products of at most this many rows packed fp16, longer ones in bf16


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


class HybridLinear:
    """Few rows: the packed fp16 product on fp32 activations; many rows: a bf16 product, returned in fp32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, rows: int = HYBRID_ROWS) -> None:
        self.packed = PackedFp16Linear(weight, bias)
        self.weight16 = weight.to(torch.bfloat16)
        self.bias = None if bias is None else bias.float()
        self.rows = rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.rows:
            return self.packed(x)
        y = F.linear(x.to(torch.bfloat16), self.weight16).float()
        return y if self.bias is None else y.add_(self.bias)

    @property
    def nbytes(self) -> int:
        """What a product streams: the packed matrix for decode-sized products (the bf16 one is the same size)."""
        return self.packed.nbytes


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """True when the CPU has native bf16 dot products (AVX512-BF16 or AMX); otherwise bf16 matmuls crawl."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


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
    if weights not in ("fp16", "hybrid"):
        return
    if device.type != "cpu" or dtype != torch.float32:
        raise EngineError(f"weights {weights} (packed for FBGEMM) needs device cpu and dtype float32, "
                          f"not {device.type} {str(dtype).removeprefix('torch.')}")
    if not fp16_packing_available():
        raise EngineError(f"weights {weights} needs FBGEMM (an x86-64 PyTorch build on an AVX2 CPU); use dense")


def choose_format(weights: str, stored: torch.dtype, weight: torch.Tensor) -> str:
    """``dense`` or ``fp16`` for one matrix, ``weight`` in the model dtype, ``stored`` its checkpoint dtype."""
    _known(weights)
    if weights != "auto":
        return weights
    cpu_fp32 = weight.device.type == "cpu" and weight.dtype == torch.float32
    if not cpu_fp32 or stored.itemsize != 2 or not fp16_packing_available():
        return "dense"
    lo, hi = torch.aminmax(weight)
    if max(-lo.item(), hi.item()) > FP16_MAX:
        return "dense"
    return "hybrid" if stored == torch.bfloat16 and cpu_has_fast_bf16() else "fp16"


def make_linear(fmt: str, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    """A matrix in the format :func:`choose_format` picked; tensors already in the model dtype."""
    if fmt == "hybrid":
        return HybridLinear(weight, bias)
    return PackedFp16Linear(weight, bias) if fmt == "fp16" else DenseLinear(weight, bias)
