"""Ladder arithmetic: pure functions and the green-ctx backend against the fake driver."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from partition_fakes import GRANULARITY, Gpu

from agentserve.executor.partition.green_ctx import GreenCtxBackend
from agentserve.executor.partition.ladder import (
    CPU_GRANULARITY,
    DEFAULT_SHARES,
    Granularity,
    build_ladder,
    granularity_from_cc,
    rung_for_decode_units,
)

SMS = (48, 64, 132, 170)
CCS = ((8, 6), (9, 0), (12, 0))


def decode_sizes(ladder):
    return [r.decode_units for r in ladder if r.partitioned]


def check_ladder(ladder, total: int, min_size: int, align: int) -> None:
    top = ladder[-1]
    assert (top.decode_units, top.prefill_units, top.partitioned) == (total, total, False)
    assert [r.index for r in ladder] == list(range(len(ladder)))
    sizes = decode_sizes(ladder)
    assert sizes == sorted(set(sizes)), "decode sizes must grow strictly (duplicates dropped)"
    assert len(sizes) <= len(DEFAULT_SHARES) - 1
    for r in ladder[:-1]:
        assert r.partitioned
        assert r.decode_units % align == 0
        assert r.decode_units >= min_size and r.prefill_units >= min_size
        assert r.decode_units + r.prefill_units == total


@pytest.mark.parametrize("cc", CCS, ids=lambda cc: f"cc{cc[0]}{cc[1]}")
@pytest.mark.parametrize("sms", SMS)
def test_green_ladder_from_queried_granularity(sms: int, cc: tuple[int, int]) -> None:
    gpu = Gpu(sms, cc)
    backend = GreenCtxBackend(gpu.drv, gpu.cuda)
    min_size, align = GRANULARITY[cc[0]]
    check_ladder(backend.ladder, sms, min_size, align)
    assert "(queried)" in backend.reason
    # one split per partitioned rung, two green contexts and two streams each
    partitioned = len(backend.ladder) - 1
    assert gpu.drv.calls["cuDevSmResourceSplitByCount"] == partitioned
    assert len(gpu.drv.live_contexts) == len(gpu.drv.live_streams) == 2 * partitioned
    assert gpu.drv.calls["cuGreenCtxGetDevResource"] == 2 * partitioned
    backend.close()


@pytest.mark.parametrize(
    ("sms", "cc", "expected"),
    [
        (48, (8, 6), [4, 10, 14, 20, 24, 28, 34, 38, 44]),
        (64, (9, 0), [8, 16, 24, 32, 40, 48, 56]),
        (132, (9, 0), [16, 24, 40, 56, 64, 80, 96, 104, 120]),
        (170, (12, 0), [16, 32, 48, 72, 88, 104, 120, 136, 152]),  # 20 % → 32 of 170, as pegainfer saw
    ],
)
def test_green_ladder_by_hand(sms: int, cc: tuple[int, int], expected: list[int]) -> None:
    gpu = Gpu(sms, cc)
    backend = GreenCtxBackend(gpu.drv, gpu.cuda)
    assert decode_sizes(backend.ladder) == expected
    assert [r.prefill_units for r in backend.ladder[:-1]] == [sms - d for d in expected]
    backend.close()


@pytest.mark.parametrize("cc", CCS, ids=lambda cc: f"cc{cc[0]}{cc[1]}")
def test_granularity_falls_back_to_cc_table_when_fields_missing(cc: tuple[int, int]) -> None:
    gpu = Gpu(132, cc, {"granularity_fields": False})
    backend = GreenCtxBackend(gpu.drv, gpu.cuda)
    gran = granularity_from_cc(*cc)
    assert (gran.min_size, gran.align) == GRANULARITY[cc[0]]
    assert f"documented CC {cc[0]}.{cc[1]} table" in backend.reason
    check_ladder(backend.ladder, 132, gran.min_size, gran.align)
    backend.close()


def test_cpu_ladders() -> None:
    two = build_ladder(2, CPU_GRANULARITY)
    assert [(r.decode_units, r.prefill_units, r.partitioned) for r in two] == [(1, 1, True), (2, 2, False)]
    one = build_ladder(1, CPU_GRANULARITY)
    assert [(r.decode_units, r.prefill_units, r.partitioned) for r in one] == [(1, 1, False)]
    assert decode_sizes(build_ladder(10, CPU_GRANULARITY)) == list(range(1, 10))


def test_too_small_device_has_only_the_plain_rung() -> None:
    ladder = build_ladder(12, Granularity(8, 8))
    assert len(ladder) == 1 and not ladder[0].partitioned


def test_rung_for_decode_units() -> None:
    ladder = build_ladder(132, Granularity(8, 8))
    assert rung_for_decode_units(ladder, 30).decode_units == 40
    assert rung_for_decode_units(ladder, 1).index == 0
    assert rung_for_decode_units(ladder, 500) is ladder[-1]


@given(
    total=st.integers(1, 300),
    min_size=st.integers(1, 16),
    align=st.sampled_from([1, 2, 4, 8, 16]),
    shares=st.lists(st.floats(0.01, 1.0), min_size=1, max_size=12),
)
def test_ladder_properties(total: int, min_size: int, align: int, shares: list[float]) -> None:
    ladder = build_ladder(total, Granularity(min_size, align), tuple(shares))
    check_ladder_any(ladder, total, min_size, align, len(shares))


def check_ladder_any(ladder, total: int, min_size: int, align: int, n_shares: int) -> None:
    top = ladder[-1]
    assert (top.decode_units, top.prefill_units, top.partitioned) == (total, total, False)
    sizes = decode_sizes(ladder)
    assert sizes == sorted(set(sizes)) and len(sizes) <= n_shares
    for r in ladder[:-1]:
        assert r.decode_units % align == 0 and r.decode_units >= min_size
        assert r.prefill_units >= min_size and r.decode_units + r.prefill_units == total


def test_explicit_split_is_used_when_split_by_count_is_missing() -> None:
    gpu = Gpu(170, (12, 0))
    gpu.drv.without("cuDevSmResourceSplitByCount")
    backend = GreenCtxBackend(gpu.drv, gpu.cuda)
    assert decode_sizes(backend.ladder) == [16, 32, 48, 72, 88, 104, 120, 136, 152]
    asked = [arg for name, arg in gpu.drv.log if name == "cuDevSmResourceSplit"]
    assert asked == [[d] for d in decode_sizes(backend.ladder)]
    backend.close()
