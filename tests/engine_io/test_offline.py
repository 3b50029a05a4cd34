"""Offline generation: same greedy tokens as the runner driven token by token, chunk-size invariance,
stopping (eos / stop ids / stop strings / length), seeds, a full KV cache, and typed errors."""

from __future__ import annotations

import pytest

from agentserve.cli.offline import LLM
from agentserve.executor.errors import EngineError, InvalidRequestError, PromptTooLongError
from agentserve.executor.runner import DecodeItem, ModelRunner, PrefillChunk
from agentserve.protocol.sampling import SamplingParams

PROMPTS = [[104, 105], [257, *range(40, 70), 258, 10], [(i * 37) % 256 for i in range(75)]]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def runner_greedy(runner: ModelRunner, prompt: list[int], n: int) -> list[int]:
    """The reference: one token per forward call, block table 0.. (the runner is private to the test)."""
    table = list(range(-(-(len(prompt) + n) // runner.block_size)))
    for pos, tok in enumerate(prompt):
        logits = runner.prefill([PrefillChunk([tok], pos, table)])
    out = [int(logits[0].argmax())]
    while len(out) < n:
        logits = runner.decode([DecodeItem(out[-1], len(prompt) + len(out) - 1, table)])
        out.append(int(logits[0].argmax()))
    return out


def test_greedy_equals_step_by_step_runner(tiny_llm, tiny_dir):
    runner = ModelRunner(tiny_dir, dtype="float32", device="cpu", num_blocks=16)
    want = [runner_greedy(runner, p, GREEDY.max_tokens) for p in PROMPTS]
    got = tiny_llm.generate(PROMPTS, GREEDY, chunk_size=16)
    assert [o.token_ids for o in got] == want
    assert all(o.finish_reason == "length" and len(o.logprobs) == 12 for o in got)
    assert all(lp <= 0.0 for o in got for lp in o.logprobs)


def test_chunk_sizes_give_identical_tokens(tiny_llm):
    outs = [tiny_llm.generate(PROMPTS, GREEDY, chunk_size=c) for c in (1, 7, 64)]
    tokens = [[o.token_ids for o in out] for out in outs]
    assert tokens[0] == tokens[1] == tokens[2]
    assert outs[0][0].text == tiny_llm.tokenizer.decode(outs[0][0].token_ids)


def test_full_cache_makes_sequences_wait_not_fail(tiny_dir, tiny_llm):
    small = LLM(tiny_dir, dtype="float32", device="cpu", num_blocks=6)  # room for one long prompt at a time
    assert [o.token_ids for o in small.generate(PROMPTS, GREEDY, chunk_size=32)] == \
        [o.token_ids for o in tiny_llm.generate(PROMPTS, GREEDY, chunk_size=32)]
    with pytest.raises(EngineError, match="more KV blocks than the cache has"):
        small.generate([[1] * 90], SamplingParams(max_tokens=20))


def test_seeded_sampling_is_batch_independent(tiny_llm):
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=7, max_tokens=10, ignore_eos=True)
    alone = tiny_llm.generate([PROMPTS[1]], p)[0].token_ids
    other = SamplingParams(temperature=0.8, max_tokens=10)
    batched = tiny_llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [other, p, other])[1].token_ids
    assert batched == alone
    assert tiny_llm.generate([PROMPTS[1]], SamplingParams(temperature=1.0, seed=8, max_tokens=10,
                                                          ignore_eos=True))[0].token_ids != alone


def test_stop_token_id_and_eos(tiny_llm):
    base = tiny_llm.generate([PROMPTS[2]], SamplingParams(temperature=1.0, seed=3, max_tokens=20,
                                                          ignore_eos=True))[0].token_ids
    target = base[6]
    first = base.index(target)
    out = tiny_llm.generate([PROMPTS[2]], SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True,
                                                         stop_token_ids=[target]))[0]
    assert out.token_ids == base[: first + 1] and out.finish_reason == "stop"
    eos_like = SamplingParams(temperature=1.0, seed=3, max_tokens=20)  # eos not ignored
    tiny_llm.eos_token_ids.add(target)
    try:
        assert tiny_llm.generate([PROMPTS[2]], eos_like)[0].token_ids == base[: first + 1]
    finally:
        tiny_llm.eos_token_ids.discard(target)


def test_stop_strings_truncate_text(tiny_llm):
    prompt = tiny_llm.tokenizer.encode("Once upon a time")
    sp = SamplingParams(temperature=1.0, seed=11, max_tokens=40, ignore_eos=True)
    full = tiny_llm.generate([prompt], sp)[0]
    ascii_runs = [full.text[i:i + 2] for i in range(4, len(full.text) - 2) if full.text[i:i + 2].isascii()
                  and full.text[i:i + 2].isprintable()]
    assert ascii_runs, full.text
    stop = ascii_runs[0]
    cut = full.text.find(stop)
    out = tiny_llm.generate([prompt], sp, stop=[[stop]])[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[:cut]
    assert out.token_ids == full.token_ids[: len(out.token_ids)] and len(out.token_ids) < 40
    assert stop in tiny_llm.tokenizer.decode(out.token_ids)  # the tokens still hold the stop string


def test_prompt_at_context_limit(tiny_llm):
    n = tiny_llm.max_model_len
    out = tiny_llm.generate([[65] * n], SamplingParams(max_tokens=5), chunk_size=1024)[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


@pytest.mark.parametrize(
    ("prompts", "params", "kwargs", "error", "match"),
    [
        ([[1] * 4097], SamplingParams(), {}, PromptTooLongError, "4097 tokens"),
        ([[1]], SamplingParams(max_tokens=0), {}, InvalidRequestError, "max_tokens must be > 0"),
        ([[1]], SamplingParams(temperature=-1.0), {}, InvalidRequestError, "temperature"),
        ([[1]], SamplingParams(top_p=0.0), {}, InvalidRequestError, "top_p"),
        ([[]], SamplingParams(), {}, InvalidRequestError, "empty"),
        ([[1, 999]], SamplingParams(), {}, InvalidRequestError, "outside the vocabulary"),
        ([[1]], SamplingParams(), {"chunk_size": 0}, InvalidRequestError, "chunk size"),
        ([[1]], [SamplingParams()] * 2, {}, InvalidRequestError, "1 prompts but 2"),
    ],
)
def test_bad_requests_raise_typed_errors(tiny_llm, prompts, params, kwargs, error, match):
    with pytest.raises(error, match=match):
        tiny_llm.generate(prompts, params, **kwargs)
