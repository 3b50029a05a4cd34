"""Shared-prefix ("cascade") decode attention: attend a prefix common to the whole batch once.

Agents served together share a system prompt and tool schema, so their sequences share the same
physical KV blocks for the first thousands of tokens (prefix caching).  Plain paged decode gathers
and attends that prefix once per sequence.  Cascade decode splits each sequence's keys into

- the *shared* part: the longest run of leading blocks identical in every row of the batch, and
- the *own* part: the rest of the sequence (at least the block being written),

attends all queries of the batch against the shared part in one call (more query rows per key,
one gather) and each query against its own part, then merges the two partial results exactly by
their log-sum-exp weights (FlashInfer's cascade / Hydragen's prefix decomposition):

    out = (e^(l1 - m)·o1 + e^(l2 - m)·o2) / (e^(l1 - m) + e^(l2 - m)),   m = max(l1, l2)

where ``o`` is a softmax-weighted value average and ``l`` the log-sum-exp of its scores.
"""

from __future__ import annotations

import torch

MIN_SHARED_TOKENS = 256  # a shorter common prefix is not worth the second attention call


def shared_blocks(rows: list[list[int]], seq_lens: list[int], block_size: int) -> int:
    """Leading blocks identical in every row, all strictly before each sequence's last (written) block.

    So the shared part holds only complete, already-written positions of every sequence (no mask),
    and every sequence keeps at least one position of its own.
    """
    if len(rows) < 2:
        return 0
    limit = min((n - 1) // block_size for n in seq_lens)
    first = rows[0]
    for i in range(limit):
        b = first[i]
        if any(r[i] != b for r in rows):
            return i
    return limit


def merge(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> torch.Tensor:
    """Exact softmax merge of two partial attentions over disjoint key sets.

    ``o*``: ``[..., D]`` outputs; ``l*``: ``[...]`` fp32 log-sum-exp of the scores; result in ``o1``'s dtype.
    """
    m = torch.maximum(l1, l2)
    w1, w2 = (l1 - m).exp_().unsqueeze(-1), (l2 - m).exp_().unsqueeze(-1)
    out = (o1.float() * w1).add_(o2.float() * w2).div_(w1 + w2)
    return out.to(o1.dtype)
