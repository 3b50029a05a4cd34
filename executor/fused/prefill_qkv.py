"""A prefill step's queries, keys and values in one pass (``prefill_qkv.c``): the qkv product's bias, the
rotary embedding, and the casts to what attention and the cache take (queries bf16 for PyTorch's bf16 attention or
fp32 for the compiled prefill kernels, keys and values fp16), bitwise
what PyTorch's passes give (``DecoderModel._attention`` and the attention backend's casts), reading and writing each
row once instead of a dozen passes (the ``bench`` model's layer at 4,096 rows on two AMX cores: 0.68 against 6.5 ms).
Loaded from the compiled CPU library (:mod:`agentserve.executor.kernels.build`); :func:`load` returns ``None`` where
no C compiler builds it or the build has no F16C, and the model keeps PyTorch's passes.
"""

from __future__ import annotations

import ctypes

import torch

from agentserve.executor.kernels import build

MAX_DIM = 1024  # the largest head size it takes (prefill_qkv.c); an even one


class PrefillQkv:
    """``prefill_qkv``: rows of a qkv product (bf16 or fp32) to rotated queries (bf16 or fp32) and fp16 keys and
    values."""

    def __init__(self, library: ctypes.CDLL) -> None:
        ptr, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._fn = library.prefill_qkv
        self._fn.argtypes = [ptr, c_int, ptr, ptr, ptr, i64, c_int, c_int, c_int, ptr, c_int, ptr, ptr, c_int]
        self._fn.restype = c_int

    def __call__(self, y: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                 kv_heads: int, threads: int = 1, query_dtype: torch.dtype = torch.bfloat16,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``y`` [T, (heads + 2 * kv_heads) * D] bf16 or fp32, ``bias`` [that width] fp32 or None, ``cos``/``sin``
        [T, D] fp32 (contiguous CPU tensors): returns q [T, heads, D] in ``query_dtype`` (bf16 or fp32), k and v
        [T, kv_heads, D] fp16 — q and k rotated (rotate-half), each value as ``(y.float() + bias)``, rotated in fp32,
        then cast."""
        rows, width = y.shape if y.dim() == 2 else (-1, -1)
        dim = cos.shape[-1] if cos.dim() == 2 else 0
        if (y.dtype not in (torch.bfloat16, torch.float32) or cos.dtype != torch.float32 or sin.dtype != torch.float32
                or dim == 0
                or width != (heads + 2 * kv_heads) * dim or cos.shape != (rows, dim) or sin.shape != cos.shape
                or (bias is not None and (bias.dtype != torch.float32 or bias.shape != (width,)))
                or query_dtype not in (torch.bfloat16, torch.float32)):
            raise ValueError(f"prefill qkv needs y [T, (heads + 2 * kv_heads) * D] bf16 or fp32, cos and sin [T, D] "
                             f"fp32 and "
                             f"an fp32 bias of y's width or none, queries bf16 or fp32, not y {y.dtype} "
                             f"{tuple(y.shape)}, cos {cos.dtype} {tuple(cos.shape)}, heads {heads}/{kv_heads}, "
                             f"queries {query_dtype}")
        tensors = (y, cos, sin) if bias is None else (y, cos, sin, bias)
        if not all(t.is_contiguous() and t.device.type == "cpu" for t in tensors):
            raise ValueError("prefill qkv needs contiguous CPU tensors")
        q = torch.empty(rows, heads, dim, dtype=query_dtype)
        k, v = (torch.empty(rows, kv_heads, dim, dtype=torch.float16) for _ in range(2))
        rc = self._fn(y.data_ptr(), int(y.dtype == torch.float32), None if bias is None else bias.data_ptr(),
                      cos.data_ptr(), sin.data_ptr(), rows, heads, kv_heads, dim, q.data_ptr(),
                      int(query_dtype == torch.bfloat16), k.data_ptr(), v.data_ptr(), threads)
        if rc == -3:
            raise ValueError(f"prefill qkv: head size {dim} is odd or above 1024")
        if rc != 0:
            raise ValueError("this build of the prefill qkv kernel has no F16C")
        return q, k, v


def load() -> PrefillQkv | None:
    """The kernel, from the library built on first use; ``None`` where the library cannot be built or loaded or was
    built without F16C.  One wrapper per loaded library."""
    return build.wrapped(_wrapper)


def _wrapper(library: ctypes.CDLL) -> PrefillQkv | None:
    return PrefillQkv(library) if library.prefill_qkv_available() else None
