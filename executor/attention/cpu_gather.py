"""Gathering a sequence's cached keys or values from an fp16 paged cache as bf16 in one pass (``gather_bf16.c``),
for PyTorch's bf16 flash attention: bitwise what ``index_select`` and the casts through fp32 give, at about a
quarter of their time (a resume's keys and values over 3,000 cached tokens: 53 against 230 µs a tensor on one AMX
core).  Loaded from the compiled CPU library (:mod:`agentserve.executor.kernels.build`); :func:`load` returns
``None`` where no C compiler builds it or the build has no F16C, and the attention backend keeps PyTorch's passes.
"""

from __future__ import annotations

import ctypes

import torch

from agentserve.executor.kernels import build


class Bf16Gather:
    """``gather_bf16``: the first ``n`` tokens of a sequence's blocks of an fp16 cache, as bf16."""

    def __init__(self, library: ctypes.CDLL) -> None:
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn = library.gather_bf16
        self._fn.argtypes = [ptr, i64, ptr, i64, i64, i64, ptr, ctypes.c_int]
        self._fn.restype = ctypes.c_int

    def __call__(self, cache: torch.Tensor, blocks: torch.Tensor, n: int, threads: int = 1) -> torch.Tensor:
        """``cache`` [num_blocks, block_size, ...] fp16, ``blocks`` [>= ceil(n / block_size)] int64 (contiguous CPU
        tensors): returns [n, ...] bf16, as ``cache.index_select(0, blocks)`` flattened to tokens, its first ``n``,
        cast to bf16."""
        if (cache.dtype != torch.float16 or blocks.dtype != torch.int64 or blocks.dim() != 1 or cache.dim() < 3
                or 0 in cache.shape):
            raise ValueError(f"bf16 gather needs an fp16 cache [blocks, block_size, ...] and int64 block ids [N], not "
                             f"{cache.dtype} {tuple(cache.shape)} and {blocks.dtype} {tuple(blocks.shape)}")
        if not (cache.is_contiguous() and blocks.is_contiguous()) or {cache.device.type, blocks.device.type} != {"cpu"}:
            raise ValueError("bf16 gather needs contiguous CPU tensors")
        if not 0 <= n <= blocks.numel() * cache.shape[1]:
            raise ValueError(f"bf16 gather: {n} tokens beyond {blocks.numel()} blocks of {cache.shape[1]}")
        out = torch.empty((n, *cache.shape[2:]), dtype=torch.bfloat16)
        rc = self._fn(cache.data_ptr(), cache.shape[0], blocks.data_ptr(), n, cache.shape[1], cache[0, 0].numel(),
                      out.data_ptr(), threads)
        if rc == -1:
            raise ValueError(f"bf16 gather: a block id outside [0, {cache.shape[0]})")
        if rc != 0:
            raise ValueError("this build of the bf16 gather has no F16C")
        return out


def load() -> Bf16Gather | None:
    """The gather, from the library built on first use; ``None`` where the library cannot be built or loaded or was
    built without F16C.  One wrapper per loaded library."""
    return build.wrapped(_wrapper)


def _wrapper(library: ctypes.CDLL) -> Bf16Gather | None:
    return Bf16Gather(library) if library.gather_bf16_available() else None
