"""cpu-cores: a decode batch and a prefill chunk run at the same time on the two lanes of one model and
one KV cache, and each gives exactly the tokens it gives when run alone."""

from __future__ import annotations

import threading

import pytest

from agentserve.executor.builtin import resolve_model
from agentserve.executor.lanes import LaneWorker
from agentserve.executor.partition.cpu_cores import CpuCoresBackend
from agentserve.executor.runner import DecodeItem, ModelRunner, PrefillChunk
from agentserve.protocol.lanes import Lane

BLOCK = 16
DECODE_STEPS = 6


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(resolve_model("tiny"), dtype="float32", device="cpu", num_blocks=96, block_size=BLOCK)


def blocks(first: int, tokens: int) -> list[int]:
    return list(range(first, first + -(-tokens // BLOCK)))


PROMPTS = {0: [5, 6, 7, 8, 9, 10, 11] * 3, 1: list(range(40, 90))}
TABLES = {s: blocks(8 * s, len(p) + DECODE_STEPS) for s, p in PROMPTS.items()}
LONG = [(i * 37) % 250 + 3 for i in range(600)]  # the prefill lane's chunk: 600 tokens
LONG_TABLE = blocks(40, len(LONG))


def warm(runner: ModelRunner) -> list[int]:
    """Prefill the decode batch's prompts; return their first tokens."""
    chunks = [PrefillChunk(p, 0, TABLES[s]) for s, p in PROMPTS.items()]
    return [int(t) for t in runner.prefill(chunks).argmax(-1)]


def decode_step(runner: ModelRunner, tokens: list[int], step: int) -> tuple[list[int], list[float]]:
    items = [DecodeItem(tokens[s], len(p) + step, TABLES[s]) for s, p in PROMPTS.items()]
    logits = runner.decode(items)
    return [int(t) for t in logits.argmax(-1)], logits[:, :4].flatten().tolist()


def prefill_long(runner: ModelRunner) -> tuple[int, list[float]]:
    logits = runner.prefill([PrefillChunk(LONG, 0, LONG_TABLE)])
    return int(logits[0].argmax()), logits[0, :8].tolist()


def run(backend: CpuCoresBackend, runner: ModelRunner, decode: bool, prefill: bool, rung: int):
    """Run the decode batch and/or the long prefill on their lanes; with both, force them to overlap."""
    both = decode and prefill
    barrier = threading.Barrier(2, timeout=30) if both else None

    def meet() -> None:
        if barrier is not None:
            barrier.wait()

    trace: list[list[int]] = []
    logit_trace: list[list[float]] = []
    with LaneWorker(backend, Lane.DECODE, rung) as dec, LaneWorker(backend, Lane.PREFILL, rung) as pre:
        long_step = pre.submit(lambda b: (meet(), prefill_long(runner))[1]) if prefill else None
        if decode:
            tokens = dec.submit(lambda b: warm(runner)).result(60)
            trace.append(tokens)
            for step in range(DECODE_STEPS):
                first = step == 0
                fn = (
                    (lambda b, t=tokens, s=step: (meet(), decode_step(runner, t, s))[1])
                    if first
                    else (lambda b, t=tokens, s=step: decode_step(runner, t, s))
                )
                tokens, logits = dec.submit(fn).result(60)
                trace.append(tokens)
                logit_trace.append(logits)
        long_result = long_step.result(120) if long_step else None
    return (trace, logit_trace), long_result


@pytest.mark.parametrize("rung", [0, -1], ids=["partitioned", "shared"])
def test_concurrent_lanes_are_token_identical_to_alone(runner: ModelRunner, rung: int) -> None:
    backend = CpuCoresBackend()
    rung = backend.ladder[rung].index
    (tokens_alone, logits_alone), _ = run(backend, runner, decode=True, prefill=False, rung=rung)
    _, prefill_alone = run(backend, runner, decode=False, prefill=True, rung=rung)
    (tokens_both, logits_both), prefill_both = run(backend, runner, decode=True, prefill=True, rung=rung)
    assert tokens_both == tokens_alone
    assert prefill_both[0] == prefill_alone[0]
    assert prefill_both[1] == pytest.approx(prefill_alone[1], abs=1e-4)
    assert len(tokens_alone) == DECODE_STEPS + 1
    for both, alone in zip(logits_both, logits_alone, strict=True):
        assert both == pytest.approx(alone, abs=1e-4)
    assert len({tuple(round(x, 3) for x in row) for row in logits_alone}) == DECODE_STEPS, "steps differ"
    backend.close()
