"""``/v1/completions`` (string and token-id prompts, continuation of a resent history), ``/v1/models``,
``/tokenize`` and ``/detokenize``."""

from __future__ import annotations

import json

import openai
import pytest


def test_string_prompt_whole_and_streamed(openai_client) -> None:
    whole = openai_client.completions.create(model="tiny", prompt="Once upon", max_tokens=8, temperature=0)
    assert whole.object == "text_completion" and whole.choices[0].finish_reason in ("stop", "length")
    streamed = list(openai_client.completions.create(model="tiny", prompt="Once upon", max_tokens=8, temperature=0,
                                                     stream=True))
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    assert streamed[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_token_ids_and_a_resent_history_continue_the_session(http, http_server) -> None:
    body = {"prompt": [5, 6, 7, 8] * 10, "max_tokens": 6, "ignore_eos": True, "temperature": 0,
            "return_token_ids": True}
    r1 = http.post("/v1/completions", json=body).json()
    out = r1["choices"][0]["token_ids"]
    assert len(out) == 6 and r1["usage"]["completion_tokens"] == 6
    sessions = len(http_server.snapshot().sessions)
    history = body["prompt"] + out + [9, 10, 11]
    with http.stream("POST", "/v1/completions", json=body | {"prompt": history, "stream": True,
                                                             "stream_options": {"include_usage": True}}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    ids = [t for e in events if e["choices"] for t in e["choices"][0]["token_ids"]]
    assert len(ids) == 6
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= (len(body["prompt"]) + 6) // 16 * 16
    assert all("usage" in e and e["usage"] is None for e in events[:-1])  # as chat's chunks, as OpenAI sends them
    assert len(http_server.snapshot().sessions) == sessions, "the resent history went to the same session"


def test_models_tokenize_detokenize(http, openai_client) -> None:
    (model,) = openai_client.models.list().data
    assert model.id == "tiny" and model.object == "model"
    assert openai_client.models.retrieve("tiny").id == "tiny"
    assert http.get("/v1/models/gpt-5").status_code == 404
    tok = http.post("/tokenize", json={"prompt": "hello world", "add_special_tokens": False}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 4096
    assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == "hello world"
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > tok["count"]
    assert http.post("/detokenize", json={"tokens": [10**7]}).status_code == 400
    assert http.post("/tokenize", json={}).status_code == 400


@pytest.mark.parametrize("prompt", [[], [-1, 2], [[1], [2]], {"a": 1}])
def test_bad_prompts_are_400(openai_client, prompt) -> None:
    with pytest.raises(openai.BadRequestError):
        openai_client.completions.create(model="tiny", prompt=prompt, max_tokens=2)


@pytest.mark.parametrize("token", [10**6, 2**63, 2**64 - 1])
def test_out_of_vocabulary_ids_are_400(http, token) -> None:
    r = http.post("/v1/completions", json={"prompt": [token], "max_tokens": 2})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/tokenize", "/v1/completions"])
def test_tokenizing_megabytes_does_not_stall_the_other_requests(http_server, path) -> None:
    """Tokenizing runs off the event loop: a prompt of megabytes (seconds of work) holds up only its own request."""
    import threading
    import time

    import httpx

    headers = {"Authorization": f"Bearer {http_server.api_key}"}
    big = {"prompt": "many words " * 300_000, "max_tokens": 1}  # 3.3 MB: far past the context, refused after
    done = threading.Event()

    def post() -> None:
        httpx.post(http_server.url + path, json=big, headers=headers, timeout=120)
        done.set()

    threading.Thread(target=post, daemon=True).start()
    time.sleep(1.0)  # the body is in and being tokenized
    t0 = time.monotonic()
    assert httpx.get(http_server.url + "/health", timeout=60).status_code == 200
    waited = time.monotonic() - t0
    if not done.is_set():  # still tokenizing: the health check must not have waited for it
        assert waited < 1.0, f"/health took {waited:.1f} s while a prompt was tokenized"
    assert done.wait(120)
