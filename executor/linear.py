"""The decoder's weight matrices and the matmul that applies them.

- :class:`DenseLinear`: the weight in the model dtype, applied with ``F.linear`` (CUDA; CPUs with native
  bf16; fp32 checkpoints by default).
- :class:`PackedFp16Linear`: the weight packed once into FBGEMM's fp16 layout and applied to fp32
  activations with fp32 accumulation (``quantized::linear_dynamic_fp16``, the kernel behind PyTorch's
  dynamic fp16 quantization).  Half the bytes of fp32 and a kernel built for the few-row products of decode.
- :class:`HybridLinear` (CPUs with native bf16 dot products): the packed fp16 matrix for the rows of
  decode tokens (exact, as above) and the checkpoint's bf16 matrix for the rows of prefill chunks (the
  activations are rounded to bf16 for the product, which oneDNN runs on the CPU's bf16 units with fp32
  accumulation; the result is fp32 again; from ~16 rows it is 1.3-2x faster than the packed product).
  Which rows are which is set per forward with :func:`bf16_rows` — by the chunk a row belongs to, never by
  the batch's size, so which rows multiply in bf16 never depends on what a chunk is batched with (the bf16
  products are oneDNN's, whose rounding on AMX varies with the product's row and thread counts).  Twice the
  weight memory of either alone; three times where the bf16 matrix also has a copy in oneDNN's blocked layout for
  those products (:func:`block_bf16_products`).  :func:`gated_mlp` keeps the bf16 rows in bf16 between the MLP's
  two products, and where every row is a bf16 row the model hands products their inputs in bf16
  (:func:`input_dtype`).

Which one a matrix gets (:func:`choose_format`) under the ``weights`` setting: ``dense`` always dense;
``fp16`` packs every matrix; ``hybrid`` makes every matrix hybrid; ``auto``, on a CPU running fp32 when the
checkpoint stored the matrix in 16 bits and every value is within fp16's range, packs it — as a hybrid
where the CPU has native bf16 and the checkpoint stored bf16, else fp16 only.  Packing loses nothing but
fp16 subnormals: a bf16 value (8 significant bits) of magnitude 2^-14 .. 65504 is exactly an fp16 (11
significant bits); below 2^-14 it rounds by at most 2^-25.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

import torch
import torch.nn.functional as F

from agentserve.executor.errors import EngineError
from agentserve.executor.layers import silu_mul

WEIGHTS_SETTINGS = ("auto", "dense", "fp16", "hybrid")  # what a user asks for; a matrix ends up as one of the rest
FP16_MAX = 65504.0
ALL_ROWS = slice(None)
PRODUCT_ROWS = 8  # a CPU bf16 product of more rows runs on a multiple of this many (:func:`on_padded_rows`)
_rows = threading.local()  # this thread's forward: which rows hybrid matrices run in bf16 (lane threads differ)


@contextlib.contextmanager
def bf16_rows(rows: torch.Tensor | slice | None, others: torch.Tensor | None = None) -> Iterator[None]:
    """During one forward pass on this thread: the rows that hybrid matrices multiply in bf16 (``ALL_ROWS``,
    ``None`` for none, or an index tensor with ``others``, the index tensor of the rest, which take the
    packed fp16 product)."""
    before = getattr(_rows, "split", None)
    _rows.split = None if rows is None else (rows, others)
    try:
        yield
    finally:
        _rows.split = before


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
        if x.is_cpu and x.dtype == torch.bfloat16:
            return on_padded_rows(lambda rows: F.linear(rows, self.weight, self.bias), x)
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.weight, self.bias) if t is not None)


class PackedFp16Linear:
    """``x @ weight.T + bias`` for fp32 ``x`` with ``weight`` held as packed fp16 (x86 CPUs, FBGEMM)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        b = None if bias is None else bias.float()
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.float(), b)
        self.shape = (weight.shape[0], weight.shape[1])
        self._nbytes = weight.numel() * 2 + (0 if b is None else b.numel() * 4)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)

    @property
    def nbytes(self) -> int:
        return self._nbytes


class HybridLinear:
    """Decode rows: the packed fp16 product on fp32 activations; prefill rows: a bf16 product, in fp32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, stored: torch.dtype | None = None) -> None:
        self.packed = PackedFp16Linear(weight, bias)
        self.weight16 = weight.to(torch.bfloat16)
        self.blocked: torch.Tensor | None = None  # weight16 in oneDNN's layout (:func:`block_bf16_products`)
        self.bias = None if bias is None else bias.float()
        self.stored = stored  # the checkpoint's dtype: bf16 means weight16 holds its values exactly

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        split = getattr(_rows, "split", None)
        if split is None:
            return self.packed(x)
        rows, others = split
        if rows is ALL_ROWS:
            return self._bf16(x)
        out = x.new_empty(x.shape[0], self.weight16.shape[0])
        out[others] = self.packed(x[others])
        out[rows] = self._bf16(x[rows])
        return out

    def _bf16(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bf16_product(x).float()
        return y if self.bias is None else y.add_(self.bias)

    def bf16_product(self, x: torch.Tensor) -> torch.Tensor:
        """The bf16 product of bf16 or fp32 rows, left in bf16 (no bias: :func:`gated_mlp` checks)."""
        x = x.to(torch.bfloat16)
        if self.blocked is None:
            return on_padded_rows(lambda rows: F.linear(rows, self.weight16), x)
        return on_padded_rows(lambda rows: _blocked_product(rows.contiguous(), self.blocked), x)

    @property
    def nbytes(self) -> int:
        """What a product streams: the packed matrix for decode-sized products (the bf16 one is the same size)."""
        return self.packed.nbytes


def on_padded_rows(product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``product(x)`` for a 2-D ``x`` of more than ``PRODUCT_ROWS`` rows on a CPU with native bf16, computed on ``x``
    with zero rows added up to a multiple of ``PRODUCT_ROWS`` (their results dropped); else ``product(x)`` as it is.

    There oneDNN builds (JIT-compiles) a bf16 kernel for each row count it meets and keeps it: 0.6-1 ms a matrix
    shape, where the product itself takes 0.1-0.2 ms at ~56 rows.  A server's prefill steps come in every row count (a
    resume is as long as its tool's answer), so a resume of a count not met before paid four such builds: on AMX,
    resumes of 40-64 rows over 3,000 cached tokens took 31-32 ms at the median the first time against 27-29 ms
    again (one thread; 24 against 18 on two), and 28 / 19-20 ms padded.  Padded, a server meets 8 counts up to 8 rows
    and one in 8 above (39 up to a 256-row chunk), and oneDNN's cache of 1,024 kernels is not cycled through.  Up to 8
    rows (decode steps, short resumes) there are few counts, and a padded product of one row took up to 1.2x as long;
    without native bf16 PyTorch's bf16 products build nothing and an 8-row one took 8x a one-row one, so neither is
    padded.  Rows are independent: each keeps its unpadded product's bits but at a few row counts that depend on the
    shape and the thread count (on AMX: 33-36 rows, and for some shapes 249-255 on two threads), where
    oneDNN picks another kernel: a bf16 rounding apart.
    """
    rows = x.shape[0]
    pad = -rows % PRODUCT_ROWS
    if pad == 0 or rows < PRODUCT_ROWS or x.dim() != 2 or not cpu_has_fast_bf16():
        return product(x)
    return product(F.pad(x, (0, 0, 0, pad)))[:rows]


def bf16_forward() -> bool:
    """Whether this thread's forward multiplies every row of its hybrid matrices in bf16 (``ALL_ROWS``: a batch of
    prefill chunks only, of a model with hybrid matrices — the runner names no rows for the others)."""
    split = getattr(_rows, "split", None)
    return split is not None and split[0] is ALL_ROWS


def input_dtype(linear: Linear) -> torch.dtype | None:
    """The dtype to hand ``linear``'s input over in: bf16 where this forward multiplies every row of it in bf16 (the
    product rounds its input so; handing it over rounded saves a pass), else ``None`` (as it is)."""
    return torch.bfloat16 if isinstance(linear, HybridLinear) and bf16_forward() else None


def residual_product(linear: Linear, x: torch.Tensor) -> torch.Tensor:
    """``linear(x)``'s values for a residual add: left in bf16 where this forward multiplies every row of a bias-less
    hybrid matrix in bf16 (the product's values are bf16 already, and the add widens them exactly as it reads them,
    where widening first would write and read an fp32 copy), else ``linear(x)``."""
    if isinstance(linear, HybridLinear) and linear.bias is None and bf16_forward():
        return linear.bf16_product(x)
    return linear(x)


def gated_mlp(gate_up: Linear, down: Linear, h: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate) * up)`` on a fused gate/up projection.

    With hybrid matrices (no biases) the bf16 rows of this forward keep the gate/up product in bf16 and take
    SwiGLU in bf16: the product is bf16 already (a bf16 matmul's result), and ``down`` rounds SwiGLU's output
    to bf16 anyway, so only SwiGLU's own rounding is added — and two fp32 copies of the widest activation
    (~15 % of a long prefill) are saved.  In a step that mixes bf16 and packed rows, the bf16 rows take the
    same bf16 SwiGLU, so a chunk's SwiGLU does not depend on what it is batched with."""
    split = getattr(_rows, "split", None)
    hybrid = isinstance(gate_up, HybridLinear) and isinstance(down, HybridLinear)
    if split is None or not hybrid or gate_up.bias is not None or down.bias is not None:
        return down(silu_mul(gate_up(h)))
    rows, _ = split
    if rows is ALL_ROWS:  # left in bf16 for the residual add (:func:`residual_product`)
        return down.bf16_product(silu_mul(gate_up.bf16_product(h)))
    y = gate_up(h)  # the bf16 rows hold bf16 values: converting them back is exact
    act = silu_mul(y)
    act[rows] = silu_mul(y[rows].to(torch.bfloat16)).float()
    return down(act)


@functools.cache
def cpu_has_amx() -> bool:
    """True when the CPU has AMX tiles, on which PyTorch multiplies bf16 (its CPU flash attention included)."""
    return getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """True when the CPU has native bf16 dot products (AVX512-BF16 or AMX); otherwise bf16 matmuls crawl."""
    return getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)() or cpu_has_amx()


ONEDNN_ROWS_HINT = 64  # rows oneDNN lays a blocked matrix out for (a hint of 1 rounds unlike F.linear from ~56 rows)


def _onednn_blocked(weight16: torch.Tensor) -> torch.Tensor | None:
    """``weight16`` reordered into oneDNN's blocked layout, or None where this build or CPU cannot (oneDNN's bf16
    products need AVX512-BF16, AMX or AVX-NE-CONVERT)."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight16, ONEDNN_ROWS_HINT)
    except (AttributeError, RuntimeError):
        return None


def _blocked_product(x: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` in bf16 from ``W``'s oneDNN-blocked copy (fp32 accumulation, as ``F.linear``)."""
    return torch.ops.mkldnn._linear_pointwise(x, blocked, None, "none", [], "")


def block_bf16_products(linears: Iterable[Linear], budget_bytes: int) -> int:
    """Give each hybrid matrix among ``linears`` a copy of its bf16 matrix in oneDNN's blocked layout, which its bf16
    products then read, where the CPU has native bf16 and all the copies fit ``budget_bytes``; the bytes added (0:
    none made).

    ``F.linear`` hands oneDNN the row-major matrix, which its matmul repacks for the bf16 units inside every call:
    on AMX a product of 56 rows took 1.7-1.9x as long as from the blocked copy (``[1408, 512]``, one or two threads;
    oneDNN's own timing of the kernel alone 145 against 72 us on one), of 4,096 rows as long.  The row-major
    ``weight16`` stays (the fused decode step reads it): a copy is its matrix's third."""
    hybrid = [x for x in linears if isinstance(x, HybridLinear)]
    size = sum(x.weight16.nbytes for x in hybrid)
    if not hybrid or size > budget_bytes or not onednn_blocking_available():
        return 0
    blocked = [_onednn_blocked(x.weight16) for x in hybrid]
    if any(b is None for b in blocked):
        return 0
    for x, b in zip(hybrid, blocked, strict=True):
        x.blocked = b
    return size


@functools.cache
def onednn_blocking_available() -> bool:
    """True where the CPU has native bf16 and oneDNN in this build lays out bf16 matrices for it, its products from
    the blocked copy matching ``F.linear``'s (:func:`block_bf16_products`)."""
    if not cpu_has_fast_bf16():
        return False
    w, x = torch.ones(32, 32, dtype=torch.bfloat16), torch.ones(4, 32, dtype=torch.bfloat16)
    blocked = _onednn_blocked(w)
    return blocked is not None and torch.equal(_blocked_product(x, blocked), F.linear(x, w))


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


def make_linear(fmt: str, weight: torch.Tensor, bias: torch.Tensor | None,
                stored: torch.dtype | None = None) -> Linear:
    """A matrix in the format :func:`choose_format` picked; tensors already in the model dtype, ``stored`` the
    checkpoint's."""
    if fmt == "hybrid":
        return HybridLinear(weight, bias, stored)
    return PackedFp16Linear(weight, bias) if fmt == "fp16" else DenseLinear(weight, bias)
