"""ModelRunner against transformers (fp32): greedy tokens, chunked prefill, resume, and raw logits."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import (
    ARCH,
    MAX_NEW,
    REL_TOL,
    GreedyDriver,
    greedy_generate,
    hf_greedy,
    hf_logits,
    random_prompts,
    rel_err,
)

from agentserve.executor.runner import DecodeItem, ModelRunner, PrefillChunk


def fp32_runner(case, num_blocks: int = 64, block_size: int = 16, attention: str = "auto") -> ModelRunner:
    runner = ModelRunner(case.path, dtype="float32", device="cpu", num_blocks=num_blocks, block_size=block_size,
                         attention_backend=attention)
    assert runner.config.architecture == ARCH[case.name]
    return runner


# auto: the compiled CPU decode kernel where a C compiler exists; torch: the PyTorch path machines without one use
@pytest.mark.parametrize("attention", ["auto", "torch"])
def test_greedy_batch_matches_transformers(case, attention):
    got = greedy_generate(fp32_runner(case, attention=attention), case.prompts, MAX_NEW)
    assert got == case.expected


@pytest.mark.parametrize("attention", ["auto", "torch"])
@pytest.mark.parametrize("chunk_size", [1, 7, 64])
def test_chunked_prefill_matches_transformers(case, chunk_size, attention):
    runner = fp32_runner(case, block_size=8, num_blocks=96, attention=attention)
    assert greedy_generate(runner, case.prompts, MAX_NEW, chunk_size) == case.expected


def test_resume_matches_scratch(case):
    """Prefill A, decode 10, append 30 tokens as one chunk, decode 20 == the whole sequence from scratch."""
    prompt, extra = case.prompts[2], random_prompts([30], seed=99)[0]
    driver = GreedyDriver(fp32_runner(case), 2)
    first = driver.generate([0], driver.prefill([0], [prompt]), 10)[0]
    # the 10th token was sampled but not fed yet: it leads the appended chunk
    resumed_logits = driver.prefill([0], [first[-1:] + extra])
    whole = prompt + first + extra
    scratch_logits = driver.prefill([1], [whole])
    assert driver.cached[0] == driver.cached[1] == len(whole)
    resumed = driver.generate([0], resumed_logits, 20)[0]
    assert rel_err(resumed_logits, scratch_logits) < REL_TOL
    assert resumed == driver.generate([1], scratch_logits, 20)[0]
    assert resumed == hf_greedy(case.hf, whole, 20)


def test_prefill_logits_match_transformers(case):
    runner = fp32_runner(case)
    tokens = case.prompts[3]
    got = runner.prefill([PrefillChunk(tokens, 0, list(range(8)))], all_logits=True)[0]
    assert got.dtype == torch.float32 and got.shape == (len(tokens), runner.config.vocab_size)
    assert rel_err(got, hf_logits(case.hf, tokens)) < REL_TOL


def test_mixed_batch_logits_match_transformers(case):
    """One prefill call with a resumed chunk and a cold chunk, then a decode batch of different lengths."""
    runner = fp32_runner(case)
    a, b = case.prompts[3], case.prompts[1]
    tables = [list(range(0, 8)), list(range(8, 16))]
    runner.prefill([PrefillChunk(a[:50], 0, tables[0])])
    got = runner.prefill([PrefillChunk(a[50:], 50, tables[0]), PrefillChunk(b, 0, tables[1])], all_logits=True)
    assert rel_err(got[0], hf_logits(case.hf, a)[50:]) < REL_TOL
    assert rel_err(got[1], hf_logits(case.hf, b)) < REL_TOL
    nxt = [7, 11]
    dec = runner.decode([DecodeItem(nxt[0], len(a), tables[0]), DecodeItem(nxt[1], len(b), tables[1])])
    assert rel_err(dec[0], hf_logits(case.hf, a + nxt[:1])[-1]) < REL_TOL
    assert rel_err(dec[1], hf_logits(case.hf, b + nxt[1:])[-1]) < REL_TOL


def test_last_token_logits_equal_all_logits_rows(case):
    runner = fp32_runner(case)
    p = case.prompts
    chunks = [PrefillChunk(p[0], 0, list(range(0, 16))), PrefillChunk(p[1], 0, list(range(16, 32)))]
    last = runner.prefill(chunks)
    rows = runner.prefill(chunks, all_logits=True)
    assert last.shape == (2, runner.config.vocab_size)
    assert torch.allclose(last[0], rows[0][-1], rtol=0, atol=1e-5)
    assert torch.allclose(last[1], rows[1][-1], rtol=0, atol=1e-5)


def test_sdpa_prefill_path_matches_transformers(case):
    """The SDPA prefill path (the CUDA default) checked on CPU: chunked greedy and mixed-batch logits."""
    runner = fp32_runner(case, block_size=8, num_blocks=96)
    runner.attention.sdpa_prefill = True
    assert greedy_generate(runner, case.prompts, MAX_NEW, chunk_size=7) == case.expected
    a = case.prompts[3]
    runner.prefill([PrefillChunk(a[:33], 0, list(range(80, 96)))])
    got = runner.prefill([PrefillChunk(a[33:], 33, list(range(80, 96)))], all_logits=True)[0]
    assert rel_err(got, hf_logits(case.hf, a)[33:]) < REL_TOL


@pytest.mark.parametrize("rows", [1, 5])
def test_blocked_cpu_attention_with_tiny_blocks(case, monkeypatch, rows):
    """Force blocks of one and of five query rows (the last one shorter) in the CPU flash path: results must
    not change."""
    from agentserve.executor.attention import torch_backend

    monkeypatch.setattr(torch_backend, "CPU_ROW_BLOCK", rows)
    runner = fp32_runner(case)
    a = case.prompts[3]
    runner.prefill([PrefillChunk(a[:20], 0, list(range(8)))])
    got = runner.prefill([PrefillChunk(a[20:], 20, list(range(8)))], all_logits=True)[0]
    assert rel_err(got, hf_logits(case.hf, a)[20:]) < REL_TOL


def test_decodes_riding_in_a_prefill_step_match_transformers(case):
    """A mixed step: two one-token continuations (attended as a decode batch) around a resumed chunk."""
    runner = fp32_runner(case)
    a, b, c = case.prompts[3], case.prompts[2], case.prompts[1]
    tables = [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))]
    runner.prefill([PrefillChunk(a[:-1], 0, tables[0]), PrefillChunk(b[:30], 0, tables[1]),
                    PrefillChunk(c[:-1], 0, tables[2])])
    plan = runner.attention.plan
    seen = []
    runner.attention.plan = lambda batch: seen.append(plan(batch)) or seen[-1]
    got = runner.prefill([PrefillChunk(a[-1:], len(a) - 1, tables[0]), PrefillChunk(b[30:], 30, tables[1]),
                          PrefillChunk(c[-1:], len(c) - 1, tables[2])], all_logits=True)
    assert seen[0].decode_rows.tolist() == [0, 1 + len(b) - 30]
    assert rel_err(got[0], hf_logits(case.hf, a)[-1:]) < REL_TOL
    assert rel_err(got[1], hf_logits(case.hf, b)[30:]) < REL_TOL
    assert rel_err(got[2], hf_logits(case.hf, c)[-1:]) < REL_TOL
