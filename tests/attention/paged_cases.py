"""Random paged-attention inputs (a KV cache with scattered block tables) and the PyTorch paged reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentserve.executor.attention.base import AttentionBatch
from agentserve.executor.attention.torch_backend import TorchAttention

CPU = torch.device("cpu")


@dataclass
class PagedCase:
    """Sequence ``i`` has ``starts[i]`` cached tokens and ``query_lens[i]`` new ones, in scattered blocks."""

    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    starts: list[int]
    query_lens: list[int]
    seed: int = 0
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        g = torch.Generator().manual_seed(self.seed)
        bs, kvh, d = self.block_size, self.kv_heads, self.head_dim
        need = [-(-(s + n) // bs) for s, n in zip(self.starts, self.query_lens, strict=True)]
        num_blocks = sum(need) + 3  # spare blocks: never read
        order = torch.randperm(num_blocks, generator=g).tolist()  # scattered: any block anywhere
        self.tables, used = [], 0
        for n in need:
            self.tables.append(order[used : used + n])
            used += n
        self.k_cache = torch.randn(num_blocks, bs, kvh, d, generator=g).to(self.dtype)
        self.v_cache = torch.randn(num_blocks, bs, kvh, d, generator=g).to(self.dtype)
        t = sum(self.query_lens)
        self.q = torch.randn(t, self.heads, d, generator=g).to(self.dtype)
        self.k = torch.randn(t, kvh, d, generator=g).to(self.dtype)
        self.v = torch.randn(t, kvh, d, generator=g).to(self.dtype)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens) and all(s > 0 for s in self.starts)

    def batch(self, is_decode: bool | None = None) -> AttentionBatch:
        bs, slots = self.block_size, []
        for table, s, n in zip(self.tables, self.starts, self.query_lens, strict=True):
            slots += [table[p // bs] * bs + p % bs for p in range(s, s + n)]
        decode = self.is_decode if is_decode is None else is_decode
        return AttentionBatch(decode, list(self.query_lens), list(self.starts), [list(t) for t in self.tables],
                              torch.tensor(slots, dtype=torch.int64))

    def run(self, backend, is_decode: bool | None = None, dtype: torch.dtype | None = None,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``backend``'s output and the caches after it wrote the new tokens (on copies, cast to ``dtype``)."""
        cast = (lambda t: t.clone()) if dtype is None else (lambda t: t.to(dtype))
        kc, vc = cast(self.k_cache), cast(self.v_cache)
        q, k, v = cast(self.q), cast(self.k), cast(self.v)
        out = backend.forward(q, k, v, kc, vc, backend.plan(self.batch(is_decode)))
        return out, kc, vc

    def reference(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The PyTorch paged reference (:class:`TorchAttention`) in fp32 on the same (rounded) inputs."""
        ref = TorchAttention(self.heads, self.kv_heads, self.head_dim, self.block_size, CPU, cascade_decode=False)
        return self.run(ref, self.is_decode, torch.float32)
