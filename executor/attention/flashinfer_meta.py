"""FlashInfer's paged-KV metadata built from our block tables (plain Python: no FlashInfer, no torch).

FlashInfer describes a batch's pages in CSR form: sequence ``i`` uses pages
``indices[indptr[i] : indptr[i + 1]]`` and holds ``last_page_len[i]`` (1 .. page_size) tokens in its last
page; queries are ``qo_indptr`` rows per sequence.  Our pages are the KV cache's blocks, in FlashInfer's
``NHD`` layout already (``[num_blocks, block_size, kv_heads, head_dim]`` per K and V).

Cascade decode (:class:`CascadeLevels`) splits a decode batch whose sequences start with the same blocks
(the agents' shared system prompt) into two levels: the shared blocks, attended by every query of the batch
as one request, and each sequence's own blocks; FlashInfer merges the two by log-sum-exp.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentserve.executor.attention import cascade


@dataclass(frozen=True)
class PagedKV:
    indptr: list[int]  # [B + 1]
    indices: list[int]  # pages of every sequence, back to back
    last_page_len: list[int]  # [B], each in 1 .. page_size


@dataclass(frozen=True)
class CascadeLevels:
    """Level 0: the shared blocks as one request queried by all ``B`` rows; level 1: each row's own."""

    qo_indptr: tuple[list[int], list[int]]
    kv: tuple[PagedKV, PagedKV]


def qo_indptr(query_lens: list[int]) -> list[int]:
    out = [0]
    for n in query_lens:
        out.append(out[-1] + n)
    return out


def paged_kv(tables: list[list[int]], seq_lens: list[int], page_size: int) -> PagedKV:
    """The pages holding positions ``0 .. seq_lens[i] - 1`` of each sequence (every length >= 1)."""
    indptr, indices, last = [0], [], []
    for table, n in zip(tables, seq_lens, strict=True):
        if n < 1:
            raise ValueError(f"a sequence of {n} tokens has no page")
        pages = -(-n // page_size)
        indices += table[:pages]
        indptr.append(len(indices))
        last.append(n - (pages - 1) * page_size)
    return PagedKV(indptr, indices, last)


def cascade_levels(tables: list[list[int]], seq_lens: list[int], page_size: int,
                   min_shared_tokens: int = cascade.MIN_SHARED_TOKENS) -> CascadeLevels | None:
    """Two levels for a decode batch sharing at least ``min_shared_tokens`` of leading blocks, else None.

    The shared part holds only complete blocks strictly before each sequence's last one
    (:func:`cascade.shared_blocks`), so every sequence keeps at least one token of its own."""
    rows = [t[: -(-n // page_size)] for t, n in zip(tables, seq_lens, strict=True)]
    shared = cascade.shared_blocks(rows, seq_lens, page_size)
    if shared == 0 or shared * page_size < min_shared_tokens:
        return None
    batch = len(rows)
    top = PagedKV([0, shared], rows[0][:shared], [page_size])
    own = paged_kv([r[shared:] for r in rows], [n - shared * page_size for n in seq_lens], page_size)
    return CascadeLevels(([0, batch], qo_indptr([1] * batch)), (top, own))
