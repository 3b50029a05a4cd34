"""``logprobs`` / ``top_logprobs`` on both endpoints: OpenAI's shapes, streamed equal to whole, and the
figures themselves against transformers on the same checkpoint (fp32, greedy)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from agentserve.executor.builtin import resolve_model

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12] * 4


def chat_logprobs(openai_client, stream: bool, **extra):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Count with me: one, two"}], max_tokens=10,
                  temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True}, **extra)
    if not stream:
        reply = openai_client.chat.completions.create(**kwargs)
        return reply.choices[0].logprobs.content, reply.usage.completion_tokens
    chunks = list(openai_client.chat.completions.create(**kwargs, stream=True))
    return [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content], None


def test_chat_logprobs_shape_and_streamed_equal_whole(openai_client) -> None:
    whole, completion_tokens = chat_logprobs(openai_client, stream=False)
    assert len(whole) == completion_tokens == 10
    for entry in whole:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode("utf-8"))
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].token == entry.token and math.isclose(tops[0], entry.logprob, abs_tol=1e-5)
    streamed, _ = chat_logprobs(openai_client, stream=True)
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in whole]


def test_no_logprobs_unless_asked(openai_client) -> None:
    reply = openai_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=3)
    assert reply.choices[0].logprobs is None


@pytest.mark.parametrize("body", [{"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21},
                                  {"logprobs": True, "top_logprobs": -1}, {"logprobs": 3}])
def test_bad_logprob_fields_are_400(http, body) -> None:
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] in ("logprobs", "top_logprobs")


def hf_top(prompt: list[int], output: list[int], k: int) -> list[tuple[list[int], list[float]]]:
    """transformers' top-``k`` logprobs at each output position of ``prompt + output``."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(resolve_model("tiny"), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logp = logits[len(prompt) - 1:len(prompt) - 1 + len(output)].log_softmax(-1)
    values, ids = logp.topk(k, dim=-1)
    return list(zip(ids.tolist(), values.tolist(), strict=True))


def test_completion_logprobs_match_transformers(http) -> None:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 4,
            "return_token_ids": True}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    out, lp = choice["token_ids"], choice["logprobs"]
    assert len(out) == len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    lengths = [len(t) for t in lp["tokens"]]
    assert lp["text_offset"] == [sum(lengths[:i]) for i in range(6)]
    for (ids, values), chosen, got, tops in zip(hf_top(PROMPT, out, 4), out, lp["token_logprobs"],
                                                lp["top_logprobs"], strict=True):
        assert chosen == ids[0] and got == pytest.approx(values[0], abs=5e-3)
        assert sorted(tops.values(), reverse=True) == pytest.approx(values[:len(tops)], abs=5e-3)


def test_completion_logprobs_streamed_equal_whole(http) -> None:
    body = {"prompt": PROMPT[:20], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    parts = [e["choices"][0]["logprobs"] for e in events if e["choices"] and e["choices"][0]["logprobs"]]
    for key in ("tokens", "token_logprobs", "text_offset"):
        assert [v for p in parts for v in p[key]] == whole[key], key
