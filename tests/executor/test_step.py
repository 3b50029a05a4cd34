"""StepExecutor: plans in, sampled tokens out — the executor's core, checked against the bare runner."""

from __future__ import annotations

import pytest
import torch

from agentserve.executor.builtin import resolve_model
from agentserve.executor.errors import InvalidRequestError
from agentserve.executor.runner import DecodeItem, ModelRunner, PrefillChunk
from agentserve.executor.sequences import SequenceTable
from agentserve.executor.step import StepExecutor
from agentserve.protocol.lanes import Lane
from agentserve.protocol.ring_messages import Plan, SeqPlan
from agentserve.protocol.sampling import Finish, SamplingParams

BLOCK = 16


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(resolve_model("tiny"), dtype="float32", device="cpu", num_blocks=64)


def _blocks(seq: int, n_tokens: int) -> list[int]:
    """Disjoint block ranges per sequence: 8 blocks each."""
    return list(range(seq * 8, seq * 8 + -(-n_tokens // BLOCK)))


def _reference(runner: ModelRunner, prompt: list[int], n: int, seq: int) -> list[int]:
    table = _blocks(seq, len(prompt) + n)
    logits = runner.prefill([PrefillChunk(prompt, 0, table)])
    out = [int(logits[0].argmax())]
    for i in range(n - 1):
        logits = runner.decode([DecodeItem(out[-1], len(prompt) + i, table)])
        out.append(int(logits[0].argmax()))
    return out


def _plan(step: int, seqs: list[SeqPlan]) -> Plan:
    return Plan(step=step, lane=Lane.DECODE, rung=0, token_budget=0, seqs=seqs)


def test_overlapped_decode_matches_runner(runner: ModelRunner) -> None:
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(40, 70)), [3] * 20]
    n = 12
    expected = [_reference(runner, p, n, s) for s, p in enumerate(prompts)]
    ex = StepExecutor(runner, SequenceTable(runner.device), eos_token_ids=[])
    params = SamplingParams(max_tokens=n)
    # Prefill in chunks of 7 tokens, every sequence in the same ragged plan.
    got: dict[int, list[int]] = {s: [] for s in range(len(prompts))}
    pos = [0] * len(prompts)
    step = 0
    while any(pos[s] < len(p) for s, p in enumerate(prompts)):
        seqs = []
        for s, p in enumerate(prompts):
            if pos[s] >= len(p):
                continue
            chunk = p[pos[s] : pos[s] + 7]
            first = pos[s] == 0
            seqs.append(
                SeqPlan(
                    s,
                    chunk,
                    pos[s],
                    new_blocks=_blocks(s, len(p) + n) if first else [],
                    sample=pos[s] + len(chunk) == len(p),
                    sampling=params if first else None,
                )
            )
            pos[s] += len(chunk)
        for r in ex.run(_plan(step, seqs)):
            if r.token_id >= 0:
                got[r.seq_id].append(r.token_id)
        step += 1
    # Decode with empty token lists: the executor feeds what it sampled last.
    for i in range(n - 1):
        seqs = [SeqPlan(s, [], len(p) + i) for s, p in enumerate(prompts)]
        for r in ex.run(_plan(step + i, seqs)):
            got[r.seq_id].append(r.token_id)
    assert [got[s] for s in range(len(prompts))] == expected
    # max_tokens reached: the last step flagged LENGTH, and a plan sent ahead is skipped.
    assert ex.run(_plan(99, [SeqPlan(0, [], len(prompts[0]) + n - 1)])) == []


def test_finish_on_eos_and_release(runner: ModelRunner) -> None:
    prompt = [1, 2, 3, 4]
    first = _reference(runner, prompt, 1, 0)[0]
    ex = StepExecutor(runner, SequenceTable(runner.device), eos_token_ids=[first])
    plan = SeqPlan(0, prompt, 0, new_blocks=[0], sampling=SamplingParams(max_tokens=5))
    (res,) = ex.run(_plan(0, [plan]))
    assert (res.token_id, res.finish) == (first, Finish.STOP)
    ignore = SeqPlan(1, prompt, 0, new_blocks=[1], sampling=SamplingParams(max_tokens=5, ignore_eos=True))
    assert ex.run(_plan(1, [ignore]))[0].finish == Finish.NONE
    ex.table.release([0, 1])
    assert len(ex.table) == 0


def test_decode_before_any_sample_is_rejected(runner: ModelRunner) -> None:
    ex = StepExecutor(runner, SequenceTable(runner.device), eos_token_ids=[])
    with pytest.raises(InvalidRequestError, match="before any sample"):
        ex.run(_plan(0, [SeqPlan(0, [], 0, new_blocks=[0], sampling=SamplingParams())]))
    with pytest.raises(InvalidRequestError, match="no sampling"):
        ex.run(_plan(1, [SeqPlan(7, [1], 0, new_blocks=[0])]))


def test_seeded_sampling_is_reproducible(runner: ModelRunner) -> None:
    def run_once() -> list[int]:
        ex = StepExecutor(runner, SequenceTable(runner.device), eos_token_ids=[])
        sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=8)
        out = [ex.run(_plan(0, [SeqPlan(0, [9, 8, 7], 0, new_blocks=[0], sampling=sp)]))[0].token_id]
        for i in range(6):
            out.append(ex.run(_plan(1 + i, [SeqPlan(0, [], 3 + i)]))[0].token_id)
        return out

    torch.manual_seed(0)
    a = run_once()
    torch.manual_seed(1)
    assert run_once() == a
