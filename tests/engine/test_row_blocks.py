"""Row-wise layers over long CPU chunks run a block of rows at a time (``layers.by_row_blocks``): the same bits as
one pass over every row, whatever the block size, for RMSNorm (with q/k norm's 3-D rows, and rounded to bf16 as it is
written) and RoPE."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentserve.executor import layers
from agentserve.executor.layers import Rotary, by_row_blocks, rms_norm


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 70), block=st.integers(1, 16), seed=st.integers(0, 2**16))
def test_blocks_give_the_bits_of_one_pass(rows, block, seed):
    g = torch.Generator().manual_seed(seed)
    hidden, weight = torch.randn(rows, 48, generator=g), torch.randn(48, generator=g)
    heads = torch.randn(rows, 3, 16, generator=g)
    rotary = Rotary(16, 10000.0, None, 128, torch.float32, torch.device("cpu"))
    cos, sin = rotary.tables(torch.randint(0, 128, (rows,), generator=g))
    whole = (layers._rms_norm(hidden, weight, 1e-6), layers._rms_norm(heads, weight[:16], 1e-6),
             rotary._rotate(heads, cos, sin))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(layers, "ROW_BLOCK", block)
        blocked = (rms_norm(hidden, weight, 1e-6), rms_norm(heads, weight[:16], 1e-6), rotary.apply(heads, cos, sin))
        rounded = rms_norm(hidden, weight, 1e-6, torch.bfloat16)  # handed to a bf16 product: rounded as written
    for a, b in zip((*blocked, rounded), (*whole, whole[0].to(torch.bfloat16)), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def test_each_block_gets_its_own_rows_of_every_argument(monkeypatch):
    monkeypatch.setattr(layers, "ROW_BLOCK", 4)
    seen = []

    def record(x, row_ids):
        seen.append((x[:, 0].tolist(), row_ids.tolist()))
        return x * 2

    x = torch.arange(10, dtype=torch.float32)[:, None].repeat(1, 3)
    out = by_row_blocks(record, x, torch.arange(10))
    assert seen == [([0, 1, 2, 3], [0, 1, 2, 3]), ([4, 5, 6, 7], [4, 5, 6, 7]), ([8, 9], [8, 9])]
    assert torch.equal(out, x * 2)
    seen.clear()
    by_row_blocks(record, x[:4], torch.arange(4))  # no more rows than a block: one call on the tensors themselves
    assert seen == [([0, 1, 2, 3], [0, 1, 2, 3])]
