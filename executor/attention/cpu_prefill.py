"""The CPU paged-prefill kernel (``paged_prefill.c``: a prefill chunk's attention on the CPU's bf16 dot-product
units) with typed arguments, loaded from the compiled CPU library (:mod:`agentserve.executor.kernels.build`).

Only CPUs with AVX512-BF16 have it (:func:`load` returns ``None`` elsewhere, and where no C compiler builds the
library); the attention backend then keeps PyTorch's fp32 flash attention for prefill.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import torch

from agentserve.executor.kernels import build


class PagedPrefillKernel:
    """``paged_prefill_f16`` / ``paged_prefill_f32``: fp32 queries and output, the cache fp16 or fp32, products in
    bf16 with fp32 sums."""

    cache_dtypes = (torch.float32, torch.float16)

    def __init__(self, library: ctypes.CDLL) -> None:
        ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        self._fns = {}
        for dtype, name in ((torch.float32, "paged_prefill_f32"), (torch.float16, "paged_prefill_f16")):
            fn = getattr(library, name)
            fn.argtypes = [ptr, ptr, ptr, i64, ptr, i32, i64, i32, ptr] + [i32] * 4 + [ctypes.c_float, i32]
            fn.restype = i32
            self._fns[dtype] = fn
        self._supports = library.paged_prefill_supports
        self._supports.argtypes, self._supports.restype = [i32] * 4, i32

    def supports(self, heads: int, kv_heads: int, dim: int, block_size: int) -> bool:
        """Whether the kernel takes this model shape (head size a multiple of 16 up to 128, at most 128 query heads,
        blocks up to 64)."""
        return bool(self._supports(heads, kv_heads, dim, block_size))

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                 start: int, scale: float, threads: int = 1) -> torch.Tensor:
        """Attention of a chunk's queries ``q`` [n, heads, D] (tokens at positions ``start`` .. ``start + n - 1``,
        causal) over the sequence's first ``start + n`` cached tokens, found through ``table`` [width] in the
        caches [blocks, bs, kv_heads, D] (the chunk's own keys already written).  Returns [n, heads, D] fp32."""
        if (q.dim() != 3 or v_cache.shape != k_cache.shape or k_cache.dim() != 4 or k_cache.shape[3] != q.shape[2]
                or table.dim() != 1):
            raise ValueError(f"paged prefill kernel: mismatched shapes q {tuple(q.shape)}, caches "
                             f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}, table {tuple(table.shape)}")
        cache = k_cache.dtype if k_cache.dtype in self.cache_dtypes else torch.float32
        for t, dtype in ((q, torch.float32), (k_cache, cache), (v_cache, cache), (table, torch.int64)):
            if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError("paged prefill kernel needs contiguous CPU tensors: fp32 queries, an fp16 or fp32 "
                                 "cache, int64 block ids")
        return self.run(q, k_cache, v_cache, table, start, scale, threads)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, start: int,
            scale: float, threads: int) -> torch.Tensor:
        """As calling the kernel, without the Python checks (the attention backend's tensors are right by
        construction).  The C side still refuses a chunk beyond its table and block ids outside the cache."""
        n, heads, dim = q.shape
        num_blocks, block_size, kv_heads, _ = k_cache.shape
        out = torch.empty_like(q)
        rc = self._fns[k_cache.dtype](q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), num_blocks,
                                      table.data_ptr(), table.numel(), start, n, out.data_ptr(), heads, kv_heads, dim,
                                      block_size, scale, threads)
        if rc == -1:
            raise ValueError(f"paged prefill kernel does not take heads={heads} kv_heads={kv_heads} dim={dim} "
                             f"block_size={block_size} (check supports() first)")
        if rc == -3:
            raise MemoryError("paged prefill kernel: no memory for its packed keys and values")
        if rc == -4:
            raise ValueError("this build of the paged prefill kernel has no bf16 dot products (no AVX512-BF16)")
        if rc == -5:
            raise ValueError(f"paged prefill kernel: a block id outside [0, {num_blocks})")
        if rc != 0:
            raise ValueError(f"paged prefill kernel: {start} + {n} tokens beyond {table.numel()} blocks of "
                             f"{block_size}, or an empty chunk")
        return out


_WRAPPING = threading.Lock()


def load() -> PagedPrefillKernel | None:
    """The kernel, from the library built on first use; ``None`` where the library cannot be built or loaded or
    this CPU has no bf16 dot products.  One wrapper per loaded library."""
    library = build.library()
    if library is None:
        return None
    with _WRAPPING:
        return _kernel(library)


@functools.cache
def _kernel(library: ctypes.CDLL) -> PagedPrefillKernel | None:
    has = library.paged_prefill_has_bf16
    has.argtypes, has.restype = [], ctypes.c_int
    return PagedPrefillKernel(library) if has() else None
