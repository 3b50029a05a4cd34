"""Bookkeeping of decode CUDA graphs, free of torch: which graph serves a step, how its batch is padded.

A decode graph replays one decode forward pass for a fixed batch size (a *bucket*) on the rung it was
captured on: a CUDA graph's kernels run on the partition (green context) of the stream that captured them,
so every rung has its own set, keyed ``(rung, bucket)``.  A step of ``n`` sequences uses the smallest
bucket ``>= n`` of its rung, its rows padded with rows that read and write nothing (length 0, slot -1); a
step larger than every bucket, or on a rung without graphs, runs eagerly.  All graphs share one memory
pool and one set of static input buffers (:mod:`.graphs_capture`); the decode lane replays one at a time
and every step ends with a host sync (the sampled tokens are read back), so a later step's inputs never
overwrite buffers an earlier replay still reads.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

G = TypeVar("G")
MAX_GRAPH_BATCH = 64  # larger decode batches run eagerly
PAD_SLOT = -1  # a padding row's KV slot: the store kernel skips it


def batch_buckets(max_batch: int = MAX_GRAPH_BATCH) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then every multiple of 8 up to ``max_batch`` (which is included)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = {b for b in (1, 2, 4) if b <= max_batch} | set(range(8, max_batch + 1, 8)) | {max_batch}
    return sorted(sizes)


def bucket_for(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding ``n`` rows, or None when ``n`` exceeds them all."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) and n >= 1 else None


@dataclass(frozen=True, order=True)
class GraphKey:
    rung: int
    bucket: int


@dataclass
class DecodeRows:
    """One step's decode inputs padded to its bucket; ``tables`` has only the ``n`` real rows."""

    n: int
    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    seq_lens: list[int]
    tables: list[list[int]]  # [n][width], each row padded with block 0 (never read past its length)


def pad_decode_rows(token_ids: list[int], positions: list[int], tables: list[list[int]], block_size: int,
                    bucket: int) -> DecodeRows:
    """Rows of a decode step (token ``token_ids[i]`` at ``positions[i]`` of the sequence in ``tables[i]``)
    plus ``bucket - n`` padding rows: token 0 at position 0, slot -1, length 0."""
    n = len(token_ids)
    if not 1 <= n <= bucket:
        raise ValueError(f"{n} rows do not fit a bucket of {bucket}")
    pad = bucket - n
    used = [t[: p // block_size + 1] for t, p in zip(tables, positions, strict=True)]
    width = max(len(r) for r in used)
    return DecodeRows(
        n=n,
        token_ids=list(token_ids) + [0] * pad,
        positions=list(positions) + [0] * pad,
        slots=[t[p // block_size] * block_size + p % block_size for t, p in zip(used, positions, strict=True)]
        + [PAD_SLOT] * pad,
        seq_lens=[p + 1 for p in positions] + [0] * pad,
        tables=[r + [0] * (width - len(r)) for r in used],
    )


class GraphTable(Generic[G]):
    """The captured graphs by :class:`GraphKey`; a rung's graphs can be dropped, all of them cleared."""

    def __init__(self, buckets: list[int]) -> None:
        self.buckets = sorted(buckets)
        self._graphs: dict[GraphKey, G] = {}

    def __len__(self) -> int:
        return len(self._graphs)

    def add(self, key: GraphKey, graph: G) -> None:
        if key.bucket not in self.buckets:
            raise ValueError(f"{key.bucket} is not a bucket ({self.buckets})")
        if key in self._graphs:
            raise ValueError(f"a graph for {key} exists already")
        self._graphs[key] = graph

    def lookup(self, rung: int, n: int) -> tuple[GraphKey, G] | None:
        """The graph for ``n`` rows on ``rung`` (the smallest bucket that holds them), or None: run eagerly."""
        bucket = bucket_for(n, self.buckets)
        key = GraphKey(rung, bucket) if bucket is not None else None
        graph = self._graphs.get(key) if key is not None else None
        return None if graph is None else (key, graph)

    def drop_rung(self, rung: int) -> list[G]:
        """Forget ``rung``'s graphs (its partition is going away); returns them for release."""
        keys = [k for k in self._graphs if k.rung == rung]
        return [self._graphs.pop(k) for k in keys]

    def clear(self) -> list[G]:
        graphs = list(self._graphs.values())
        self._graphs.clear()
        return graphs


def capture_order(rungs: Iterable[int], buckets: list[int]) -> list[GraphKey]:
    """Rung by rung, largest bucket first: later, smaller graphs reuse the shared pool's blocks."""
    return [GraphKey(r, b) for r in rungs for b in sorted(buckets, reverse=True)]


def memory_estimate(*, max_batch: int, hidden: int, intermediate: int, q_size: int, kv_size: int, vocab: int,
                    num_heads: int, head_dim: int, dtype_bytes: int, max_splits: int) -> int:
    """Bytes the shared graph pool may hold: the largest bucket's live activations at their peak (one
    layer's, as earlier ones are freed inside a capture), its fp32 logits and split-K partials, doubled
    for the allocator's rounding and block reuse across buckets."""
    d_pad = 1 << max(4, (head_dim - 1).bit_length())
    per_row = dtype_bytes * (3 * hidden + q_size + 2 * kv_size + 3 * intermediate + vocab) + 4 * vocab
    partials = 4 * num_heads * max_splits * (d_pad + 1)
    return 2 * max_batch * (per_row + partials)
