"""The CPU paged-prefill kernels with typed arguments, loaded from the compiled CPU library
(:mod:`agentserve.executor.kernels.build`): a prefill chunk's attention over keys and values read in place from the
paged cache.

- ``bf16`` (``paged_prefill.c``): products on the CPU's bf16 dot-product units; only CPUs with AVX512-BF16 have it.
- ``fp32`` (``paged_prefill_fp32.c``): fp32 products on AVX2 + FMA (+ F16C for an fp16 cache); the fastest prefill
  attention measured on CPUs without AVX-512 (:func:`preferred`).

:func:`load` returns ``None`` where the CPU or the build lacks a kernel, or no C compiler builds the library; the
attention backend then keeps PyTorch's fp32 flash attention for prefill.
"""

from __future__ import annotations

import ctypes

import torch

from agentserve.executor.kernels import build

# per variant: the prefix of its entry points (<prefix>_f16, <prefix>_f32, <prefix>_supports) and the function
# saying whether this build has it
_SYMBOLS = {"bf16": ("paged_prefill", "paged_prefill_has_bf16"),
            "fp32": ("paged_prefill_fp32", "paged_prefill_fp32_available")}
NEEDS = {"bf16": "AVX512-BF16 dot products", "fp32": "AVX2 + FMA + F16C"}  # what each variant's build needs


class PagedPrefillKernel:
    """One variant's ``<prefix>_f16`` / ``<prefix>_f32``: fp32 queries and output, the cache fp16 or fp32, products
    in bf16 (``bf16``) or fp32 (``fp32``) with fp32 sums."""

    cache_dtypes = (torch.float32, torch.float16)

    def __init__(self, library: ctypes.CDLL, variant: str = "bf16") -> None:
        ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        self.variant = variant
        prefix, _ = _SYMBOLS[variant]
        self._fns = {}
        for dtype, name in ((torch.float32, f"{prefix}_f32"), (torch.float16, f"{prefix}_f16")):
            fn = getattr(library, name)
            fn.argtypes = [ptr, ptr, ptr, i64, ptr, i32, i64, i32, ptr] + [i32] * 4 + [ctypes.c_float, i32]
            fn.restype = i32
            self._fns[dtype] = fn
        self._supports = getattr(library, f"{prefix}_supports")
        self._supports.argtypes, self._supports.restype = [i32] * 4, i32

    def supports(self, heads: int, kv_heads: int, dim: int, block_size: int) -> bool:
        """Whether the kernel takes this model shape (head size a multiple of 16 (``bf16``) or 8 (``fp32``) up to
        128, at most 128 query heads, blocks up to 64)."""
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
            raise ValueError(f"this build of the {self.variant} paged prefill kernel has no {NEEDS[self.variant]}")
        if rc == -5:
            raise ValueError(f"paged prefill kernel: a block id outside [0, {num_blocks})")
        if rc != 0:
            raise ValueError(f"paged prefill kernel: {start} + {n} tokens beyond {table.numel()} blocks of "
                             f"{block_size}, or an empty chunk")
        return out


def load(variant: str = "bf16") -> PagedPrefillKernel | None:
    """The ``variant`` kernel (``bf16`` or ``fp32``), from the library built on first use; ``None`` where the library
    cannot be built or loaded or this build lacks that kernel.  One wrapper per loaded library and variant."""
    return build.wrapped(_kernel, variant)


def preferred() -> bool:
    """Whether ``auto`` takes the fp32 kernel over PyTorch's flash attention: where the library was built without
    AVX-512 (there both multiply on 8-wide FMAs, and the kernel measured faster)."""
    library = build.library()
    if library is None:
        return False
    fn = library.paged_prefill_fp32_preferred
    fn.argtypes, fn.restype = [], ctypes.c_int
    return bool(fn())


def _kernel(library: ctypes.CDLL, variant: str) -> PagedPrefillKernel | None:
    has = getattr(library, _SYMBOLS[variant][1])
    has.argtypes, has.restype = [], ctypes.c_int
    return PagedPrefillKernel(library, variant) if has() else None
