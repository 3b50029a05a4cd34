"""The CPU paged-decode kernel (``paged_decode.c``) with typed arguments, loaded from the compiled CPU library
(built by :mod:`agentserve.executor.kernels.build`; the library also holds the fused decode step, which calls it).

PyTorch's decode path must first gather each sequence's blocks into a contiguous copy, and no installable
library attends a paged cache in place on an AVX2 CPU (Intel's extension is pinned to particular PyTorch
releases and being retired, vLLM's CPU kernels are not a separate library, SGLang's target AVX-512 Xeons).
A machine without a working C compiler gets ``None`` from :func:`load` and the PyTorch path.
"""

from __future__ import annotations

import ctypes

import torch

from agentserve.executor.kernels import build


class PagedDecodeKernel:
    """``paged_decode_f32`` / ``paged_decode_f16`` with typed arguments; tensors must be contiguous and on the CPU.

    The query and the output are fp32; the caches fp32, or fp16 where the build reads them (:attr:`reads_f16`:
    the CPU has F16C)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.library = library  # also holds the fused decode step (:mod:`agentserve.executor.fused`)
        ptr, i32 = ctypes.c_void_p, ctypes.c_int
        self._fns = {}
        for dtype, name in ((torch.float32, "paged_decode_f32"), (torch.float16, "paged_decode_f16")):
            fn = getattr(library, name)
            fn.argtypes = [ptr] * 3 + [ctypes.c_int64] + [ptr] * 3 + [i32] * 6 + [ctypes.c_float, i32]
            fn.restype = i32
            self._fns[dtype] = fn
        self._supports = library.paged_decode_supports
        self._supports.argtypes, self._supports.restype = [i32] * 4, i32
        has_f16 = library.paged_decode_has_f16
        has_f16.argtypes, has_f16.restype = [], i32
        self.reads_f16 = bool(has_f16())
        # the vector width of its walk for 3+ query heads per KV head: 16 (AVX-512), 8 or 1; 0 for a source older than
        # the symbol (scripts/bench_decode_kernel.py wraps earlier versions to compare them)
        lanes = getattr(library, "paged_decode_lanes", None)
        if lanes is not None:
            lanes.argtypes, lanes.restype = [], i32
        self.lanes = int(lanes()) if lanes is not None else 0
        self.cache_dtypes = (torch.float32, torch.float16) if self.reads_f16 else (torch.float32,)

    def supports(self, heads: int, kv_heads: int, dim: int, block_size: int) -> bool:
        """Whether the kernel takes this model shape (it has fixed limits on heads, dim and block size)."""
        return bool(self._supports(heads, kv_heads, dim, block_size))

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor, scale: float, threads: int = 1) -> torch.Tensor:
        """Attention of ``q`` [B, heads, D] (one new token per sequence) over each sequence's first
        ``lens[b]`` cached tokens, found through ``tables`` [B, width] in the caches [blocks, bs, kv_heads, D]."""
        b, heads, dim = q.shape
        if (v_cache.shape != k_cache.shape or k_cache.shape[3] != dim or tables.dim() != 2 or tables.shape[0] != b
                or lens.shape != (b,)):
            raise ValueError(f"paged decode kernel: mismatched shapes q {tuple(q.shape)}, caches "
                             f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}, tables {tuple(tables.shape)}, "
                             f"lens {tuple(lens.shape)}")
        cache = k_cache.dtype if k_cache.dtype in self.cache_dtypes else torch.float32
        for t, dtype in ((q, torch.float32), (k_cache, cache), (v_cache, cache), (tables, torch.int64),
                         (lens, torch.int64)):
            if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"paged decode kernel needs contiguous CPU {dtype} tensors "
                                 f"(caches: one of {[str(d) for d in self.cache_dtypes]})")
        return self.run(q, k_cache, v_cache, tables, lens, scale, threads)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
            lens: torch.Tensor, scale: float, threads: int) -> torch.Tensor:
        """As calling the kernel, without the Python checks of shapes, dtypes and layout: for a caller whose
        tensors are right by construction (the attention backend, once per layer).  The C side still refuses
        lengths and block ids outside the cache."""
        b, heads, dim = q.shape
        num_blocks, block_size, kv_heads, _ = k_cache.shape
        out = torch.empty_like(q)
        fn = self._fns[k_cache.dtype]
        rc = fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), num_blocks, tables.data_ptr(), lens.data_ptr(),
                out.data_ptr(), b, heads, kv_heads, dim, block_size, tables.shape[1], scale, threads)
        if rc == -1:
            raise ValueError(f"paged decode kernel does not take heads={heads} kv_heads={kv_heads} dim={dim} "
                             f"block_size={block_size} (check supports() first)")
        if rc == -4:
            raise ValueError("this build of the paged decode kernel does not read fp16 caches (no F16C)")
        if rc == -3:
            raise MemoryError("paged decode kernel: no memory for its softmax state")
        if rc != 0:
            raise ValueError(f"paged decode kernel: a length outside 1..{tables.shape[1] * block_size} or a block "
                             f"id outside [0, {num_blocks})")
        return out


def load() -> PagedDecodeKernel | None:
    """The kernel, from the library built on first use; ``None`` where the library cannot be built or loaded.
    One wrapper per loaded library."""
    return build.wrapped(PagedDecodeKernel)
