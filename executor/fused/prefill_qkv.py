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
        self._fn.argtypes = [ptr, ptr, ptr, i64, i64, i64, c_int, ptr, ptr, ptr, i64, c_int, c_int, c_int, ptr, c_int,
                             ptr, ptr, c_int]
        self._fn.restype = c_int

    def __call__(self, y: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                 kv_heads: int, threads: int = 1, query_dtype: torch.dtype = torch.bfloat16,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``y`` [T, (heads + 2 * kv_heads) * D] bf16 or fp32, ``bias`` [that width] fp32 or None, ``cos``/``sin``
        [T, D] fp32 (CPU tensors): returns q [T, heads, D] in ``query_dtype`` (bf16 or fp32), k and v [T, kv_heads, D]
        fp16 — q and k rotated (rotate-half), each value as ``(y.float() + bias)``, rotated in fp32, then cast."""
        dim = cos.shape[-1] if cos.dim() == 2 else 0
        if y.dim() != 2 or dim == 0 or y.shape[1] != (heads + 2 * kv_heads) * dim:
            raise ValueError(f"prefill qkv needs y [T, (heads + 2 * kv_heads) * D] for heads {heads}/{kv_heads} and "
                             f"cos [T, D], not y {tuple(y.shape)}, cos {tuple(cos.shape)}")
        q_in, k_in, v_in = y.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
        return self.parts(q_in, k_in, v_in, bias, cos, sin, threads, query_dtype)

    def parts(self, q_in: torch.Tensor, k_in: torch.Tensor, v_in: torch.Tensor, bias: torch.Tensor | None,
              cos: torch.Tensor, sin: torch.Tensor, threads: int = 1, query_dtype: torch.dtype = torch.bfloat16,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As calling it, from q [T, heads * D], k and v [T, kv_heads * D] given apart (one dtype, bf16 or fp32, each
        row contiguous: column slices of one product, or q and k through q/k norms beside its v); ``bias`` [all their
        widths] or None."""
        rows, dim = q_in.shape[0], (cos.shape[-1] if cos.dim() == 2 else 0)
        inputs = (q_in, k_in, v_in)
        if (any(t.dim() != 2 or t.shape[0] != rows or t.dtype != q_in.dtype or t.stride(1) != 1 for t in inputs)
                or q_in.dtype not in (torch.bfloat16, torch.float32) or dim == 0
                or any(t.shape[1] % dim for t in inputs) or k_in.shape[1] != v_in.shape[1]
                or cos.dtype != torch.float32 or sin.dtype != torch.float32
                or cos.shape != (rows, dim) or sin.shape != cos.shape
                or query_dtype not in (torch.bfloat16, torch.float32)
                or (bias is not None and (bias.dtype != torch.float32
                                          or bias.shape != (sum(t.shape[1] for t in inputs),)))):
            raise ValueError(f"prefill qkv needs q, k, v [T, heads * D] of one dtype, bf16 or fp32, rows contiguous, "
                             f"cos and sin [T, D] fp32, an fp32 bias of their widths or none, queries bf16 or fp32; "
                             f"not {[(t.dtype, tuple(t.shape)) for t in inputs]}, cos {cos.dtype} {tuple(cos.shape)}, "
                             f"queries {query_dtype}")
        tensors = (*inputs, cos, sin) if bias is None else (*inputs, cos, sin, bias)
        if (not all(t.device.type == "cpu" for t in tensors)
                or not all(t.is_contiguous() for t in tensors[3:])):
            raise ValueError("prefill qkv needs CPU tensors, cos, sin and bias contiguous")
        heads, kv_heads = q_in.shape[1] // dim, k_in.shape[1] // dim
        q = torch.empty(rows, heads, dim, dtype=query_dtype)
        k, v = (torch.empty(rows, kv_heads, dim, dtype=torch.float16) for _ in range(2))
        rc = self._fn(q_in.data_ptr(), k_in.data_ptr(), v_in.data_ptr(), q_in.stride(0), k_in.stride(0),
                      v_in.stride(0), int(q_in.dtype == torch.float32), None if bias is None else bias.data_ptr(),
                      cos.data_ptr(), sin.data_ptr(), rows, heads, kv_heads, dim, q.data_ptr(),
                      int(query_dtype == torch.bfloat16), k.data_ptr(), v.data_ptr(), threads)
        if rc == -3:
            raise ValueError(f"prefill qkv: head size {dim} is odd or above {MAX_DIM}")
        if rc != 0:
            raise ValueError("this build of the prefill qkv kernel has no F16C")
        return q, k, v


def load() -> PrefillQkv | None:
    """The kernel, from the library built on first use; ``None`` where the library cannot be built or loaded or was
    built without F16C.  One wrapper per loaded library."""
    return build.wrapped(_wrapper)


def _wrapper(library: ctypes.CDLL) -> PrefillQkv | None:
    return PrefillQkv(library) if library.prefill_qkv_available() else None
