"""Decode-graph bookkeeping (torch-free): buckets, padding, keys per rung, invalidation; and the executor
capturing each rung's graphs on that rung's decode lane at start-up."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from agentserve.executor import graphs
from agentserve.executor.graphs import GraphKey, GraphTable, bucket_for, pad_decode_rows
from agentserve.executor.partition.base import LaneBinding, PartitionBackend
from agentserve.executor.process import Executor
from agentserve.protocol.lanes import Lane, Rung


def test_buckets():
    assert graphs.batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graphs.batch_buckets(3) == [1, 2, 3]
    assert graphs.batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    with pytest.raises(ValueError):
        graphs.batch_buckets(0)


@given(n=st.integers(-2, 80), top=st.integers(1, 70))
def test_bucket_for_is_the_smallest_that_holds(n, top):
    buckets = graphs.batch_buckets(top)
    got = bucket_for(n, buckets)
    if n < 1 or n > top:
        assert got is None
    else:
        assert got >= n and all(b < n for b in buckets if b < got)


def test_padding_rows_read_and_write_nothing():
    rows = pad_decode_rows([7, 9], [5, 0], [[3, 4, 8], [6, 1]], 4, bucket=4)
    assert rows.n == 2
    assert rows.token_ids == [7, 9, 0, 0] and rows.positions == [5, 0, 0, 0]
    assert rows.slots == [4 * 4 + 1, 6 * 4, -1, -1]  # position 5 is row 1 of block 4
    assert rows.seq_lens == [6, 1, 0, 0]
    assert rows.tables == [[3, 4], [6, 0]]  # cut to the blocks used, padded with block 0
    with pytest.raises(ValueError):
        pad_decode_rows([1] * 5, [0] * 5, [[0]] * 5, 4, bucket=4)


def test_graph_table_keys_by_rung_and_bucket():
    table: GraphTable[str] = GraphTable([1, 2, 4, 8])
    for key in graphs.capture_order([0, 2], [1, 2, 4, 8]):
        table.add(key, f"r{key.rung}b{key.bucket}")
    assert graphs.capture_order([5], [1, 4, 2]) == [GraphKey(5, 4), GraphKey(5, 2), GraphKey(5, 1)]
    assert table.lookup(0, 3) == (GraphKey(0, 4), "r0b4")
    assert table.lookup(2, 3) == (GraphKey(2, 4), "r2b4")  # a rung change selects another graph
    assert table.lookup(1, 3) is None  # a rung without graphs runs eagerly
    assert table.lookup(0, 9) is None  # so does a batch larger than every bucket
    with pytest.raises(ValueError):
        table.add(GraphKey(0, 4), "again")
    with pytest.raises(ValueError):
        table.add(GraphKey(0, 3), "not a bucket")
    assert sorted(table.drop_rung(2)) == ["r2b1", "r2b2", "r2b4", "r2b8"]
    assert table.lookup(2, 3) is None and len(table) == 4
    assert len(table.clear()) == 4 and len(table) == 0


def test_memory_estimate_grows_with_batch_and_vocab():
    kw = dict(hidden=2048, intermediate=8192, q_size=2048, kv_size=512, vocab=128256, num_heads=32, head_dim=64,
              dtype_bytes=2, max_splits=16)
    small, big = graphs.memory_estimate(max_batch=8, **kw), graphs.memory_estimate(max_batch=64, **kw)
    assert big == 8 * small
    assert 64 * 128256 * 4 < big < 1 << 30  # at least the fp32 logits, well under a GiB for a ~1B model


class LadderBackend(PartitionBackend):
    """A partition backend with a given ladder and no hardware: bindings carry no stream."""

    name, unit = "fake", "SMs"

    @contextmanager
    def _bind(self, lane: Lane, rung: Rung):
        units = rung.decode_units if lane == Lane.DECODE else rung.prefill_units
        yield LaneBinding(lane=lane, rung=rung, units=units)

    def _release(self) -> None:
        pass


class GraphRunner:
    """Records graph captures the way the executor asks for them."""

    device = torch.device("cpu")
    config = SimpleNamespace(eos_token_ids=[], vocab_size=32)
    model_dir = Path("no-checkpoint")  # the grammar masks read its tokenizer only when a grammar is used
    max_model_len = 64

    def __init__(self, fail_at: int | None = None) -> None:
        self.captured: list[tuple[int, int, str]] = []
        self.dropped = 0
        self.fail_at = fail_at

    def graphs_unavailable(self):
        return None

    def capture_graphs(self, rung: int, units: int) -> int:
        if rung == self.fail_at:
            raise RuntimeError("capture failed")
        self.captured.append((rung, units, threading.current_thread().name))
        return 3

    def drop_graphs(self) -> None:
        self.dropped += 1


LADDER = [Rung(index=0, decode_units=16, prefill_units=116, partitioned=True),
          Rung(index=1, decode_units=64, prefill_units=68, partitioned=True),
          Rung(index=2, decode_units=132, prefill_units=132, partitioned=False)]


@pytest.mark.parametrize("fail_at", [None, 1])
def test_executor_captures_every_rung_on_its_decode_lane(fail_at):
    runner = GraphRunner(fail_at)
    backend = LadderBackend(LADDER, "fake", "test")
    executor = Executor(pair=None, runner=runner, backend=backend)
    for lane in executor.lanes.values():
        lane.start()
    try:
        executor.capture_graphs()
    finally:
        for lane in executor.lanes.values():
            lane.stop()
        backend.close()
    if fail_at is None:
        assert runner.captured == [(r.index, r.decode_units, "lane-decode") for r in LADDER]
        assert runner.dropped == 0
    else:
        assert [c[0] for c in runner.captured] == [0] and runner.dropped == 1  # eager from then on


def test_cuda_graphs_setting_reaches_the_runner():
    from agentserve import configs
    from agentserve.cli.up import _executor_args
    from agentserve.executor.__main__ import parse

    engine = configs.load("engine", None, {"engine": {"cuda_graphs": "off"}}, environ={})["engine"]
    opts, _ = parse(["--run", "r", "--model", "/m", *_executor_args(engine, None)])
    assert opts.runner["cuda_graphs"] == "off"
    default = configs.load("engine", None, {}, environ={})["engine"]
    assert default["cuda_graphs"] == "auto" and "--cuda-graphs" not in _executor_args(default, None)


def test_unknown_cuda_graphs_setting_is_refused(tmp_path):
    from agentserve.executor.builtin import resolve_model
    from agentserve.executor.errors import EngineError
    from agentserve.executor.runner import ModelRunner

    with pytest.raises(EngineError, match="cuda_graphs"):
        ModelRunner(resolve_model("tiny", str(tmp_path)), device="cpu", num_blocks=4, cuda_graphs="always")
