"""Request limits over HTTP, with a server started on small ones (``up --config``): what a turn carries is checked by
the orchestrator on what the turn sends (a continued conversation: its new messages or tokens), and what the gateway
works on before any turn exists by the limits the server announced: a prompt's text before the gateway tokenises it
(megabytes take seconds of a worker thread), a ``/tokenize`` conversation as a cold chat would send it."""

from __future__ import annotations

import os
import subprocess
from types import SimpleNamespace

import httpx
import pytest

from agentserve.executor.builtin import build_tokenizer
from agentserve.executor.builtin_template import CHAT_TEMPLATE
from agentserve.gateway.backend import Backend, GatewayOptions
from agentserve.gateway.completions import prompt_ids
from agentserve.gateway.errors import APIError
from agentserve.gateway.schemas import CompletionRequest
from agentserve.orchestrator.text.tokenization import Tokenizer
from agentserve.protocol.limits import Limits

from .conftest import HttpServer

LIMITS = """
[request]
max_messages = 3
max_text_bytes = 2048
max_stop_strings = 2
max_token_ids = 4000
max_system_bytes = 1024

[clients]
tokenize_inline_bytes = 1024
max_tokenizing_bytes = 4096
max_sessions = 8
"""


@pytest.fixture(scope="module")
def small_limits(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("limits")
    config = tmp / "limits.toml"
    config.write_text(LIMITS)
    server = HttpServer(tmp, extra=["--config", str(config)])
    yield server
    logs = server.logs()
    assert server.stop() == 0, logs
    assert not [n for n in os.listdir("/dev/shm") if server.run in n]


@pytest.fixture
def http(small_limits: HttpServer):
    with httpx.Client(base_url=small_limits.url, timeout=60) as client:
        yield client


def refused(response: httpx.Response, name: str, param: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "limit_exceeded" and error["param"] == param, error
    assert f"limits.request.{name}" in error["message"], error


USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize("path, body, name, param", [
    ("/v1/chat/completions", {"messages": [USER] * 4, "max_tokens": 1}, "max_messages", "messages"),
    ("/v1/chat/completions", {"messages": [USER], "stop": ["a", "b", "c"], "max_tokens": 1},
     "max_stop_strings", "stop"),
    ("/v1/completions", {"prompt": "é" * 1025, "max_tokens": 1}, "max_text_bytes", "prompt"),
    ("/v1/completions", {"prompt": ["x" * 2049], "max_tokens": 1}, "max_text_bytes", "prompt"),
    ("/v1/completions", {"prompt": [1] * 4001, "max_tokens": 1}, "max_token_ids", "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c"], "max_tokens": 1}, "max_stop_strings", "stop"),
    ("/tokenize", {"prompt": "x" * 2049}, "max_text_bytes", "prompt"),
    ("/tokenize", {"messages": [USER] * 4}, "max_messages", "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x" * 2049}]}, "max_text_bytes", "messages"),
    ("/tokenize", {"messages": [{"role": "system", "content": "x" * 1025}, USER]}, "max_system_bytes", "messages"),
])
def test_the_gateway_refuses_past_the_limits_the_server_announced(http, path, body, name, param) -> None:
    refused(http.post(path, json=body), name, param)


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [USER] * 3, "stop": ["a", "b"], "max_tokens": 1}),
    ("/v1/completions", {"prompt": "x" * 2048, "max_tokens": 1}),
    ("/v1/completions", {"prompt": [1] * 4000, "max_tokens": 1}),
    ("/tokenize", {"messages": [{"role": "system", "content": "x" * 1024}, {"role": "user", "content": "y" * 2048}]}),
])
def test_at_the_limits_a_request_is_served(http, path, body) -> None:
    assert http.post(path, json=body).status_code == 200, http.post(path, json=body).text


def test_a_cold_chat_sends_its_system_prompt_apart_from_the_turns_messages(http) -> None:
    body = {"messages": [{"role": "system", "content": "be brief"}, *[USER] * 3], "max_tokens": 1}
    assert http.post("/v1/chat/completions", json=body).status_code == 200


def test_a_continued_chat_is_bounded_by_the_messages_it_sends_not_its_history(http) -> None:
    messages = [USER]
    for _ in range(3):  # 1, 3, then 5 messages of history: each turn sends the reply's successor only
        r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        messages = [*messages, r.json()["choices"][0]["message"], USER]
    assert len(messages) == 7


def test_a_continued_completion_is_bounded_by_the_tokens_it_sends_not_its_history(http) -> None:
    body = {"prompt": [5] * 3500, "max_tokens": 4, "ignore_eos": True, "temperature": 0, "return_token_ids": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    history = body["prompt"] + r.json()["choices"][0]["token_ids"] + [6] * 500  # 4,004 ids, 504 of them new
    r = http.post("/v1/completions", json=body | {"prompt": history})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 3500 // 16 * 16


class Unreachable:
    def encode(self, *args: object, **kwargs: object) -> list[int]:
        raise AssertionError("tokenised a prompt over the text bound")


def test_a_prompt_over_the_text_bound_is_refused_before_it_is_tokenised() -> None:
    backend = Backend(GatewayOptions(endpoint="ipc:///unused"))
    backend.client, backend.welcome, backend.tokenizer = object(), object(), Unreachable()
    backend.limits = Limits(max_text_bytes=8)
    for prompt in ("123456789", ["123456789"]):
        with pytest.raises(APIError) as e:
            prompt_ids(CompletionRequest(prompt=prompt), backend)
        assert (e.value.status, e.value.param, e.value.code) == (400, "prompt", "limit_exceeded")
        assert "limits.request.max_text_bytes" in e.value.message


def test_a_text_prompt_past_the_context_is_refused_as_such_whatever_it_tokenises_to() -> None:
    """Past the context and past ``max_token_ids`` too (megabytes of text): still ``context_length_exceeded``, the
    refusal for what the client sent, not the token-id limit it did not use."""
    backend = Backend(GatewayOptions(endpoint="ipc:///unused"))
    backend.client, backend.welcome = object(), SimpleNamespace(max_model_len=16)
    backend.tokenizer = Tokenizer(build_tokenizer(), {}, {"default": CHAT_TEMPLATE}, [])
    backend.limits = Limits(max_token_ids=10)
    assert len(prompt_ids(CompletionRequest(prompt="a" * 15), backend)) == 15
    with pytest.raises(APIError) as e:
        prompt_ids(CompletionRequest(prompt="a" * 16), backend)
    assert (e.value.status, e.value.param, e.value.code) == (400, "prompt", "context_length_exceeded")
    assert "16 tokens" in e.value.message and "holds 15" in e.value.message


def test_until_the_server_announces_its_limits_the_gateway_holds_the_defaults() -> None:
    assert Backend(GatewayOptions(endpoint="ipc:///unused")).limits == Limits()
    assert Limits.announced({}) == Limits()
    assert Limits.announced({"max_messages": 7, "a_limit_of_a_newer_server": 1}) == Limits(max_messages=7)
    assert Limits.announced({"max_tools": True, "max_stop_strings": 2.5, "max_messages": 0}) == Limits()


def test_a_welcome_with_limits_of_any_type_still_decodes() -> None:
    """A newer server may announce a limit that is no integer: the handshake must not fail on it."""
    import msgspec

    from agentserve.protocol.client_messages import ClientCodec, Welcome

    frame = msgspec.msgpack.encode(Welcome(1, 1, limits={"max_messages": 9, "max_turn_s": 1.5, "mode": "x"}))
    welcome = ClientCodec().decode(frame)
    assert Limits.announced(welcome.limits) == Limits(max_messages=9)


def test_choices_refused_past_the_session_limit_are_no_aborts(small_limits: HttpServer, http) -> None:
    """n = 9 choices, one session each, past the connection's 8: a 503 ``busy``, and the 8 choices that had started
    their turns were counted as aborts in ``request_success{finished_reason="abort"}``."""
    from prometheus_client.parser import text_string_to_metric_families

    def aborts() -> float:
        text = http.get("/metrics").text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "agentserve:request_success_total" and s.labels.get("finished_reason") == "abort")

    before = aborts()
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "n": 9,
                                                "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "busy", r.text
    assert aborts() == before


def test_the_server_announces_its_request_limits(small_limits: HttpServer) -> None:
    from agentserve.client import AgentClient

    with AgentClient(small_limits.endpoint) as client:
        announced = Limits.announced(client.server.limits)
    assert (announced.max_messages, announced.max_text_bytes, announced.max_stop_strings) == (3, 2048, 2)


def test_up_gives_the_gateway_its_clients_bounds(small_limits: HttpServer) -> None:
    """``[clients]`` of ``up --config`` reaches the gateway's tokenising lanes."""
    out = subprocess.run(["pgrep", "-af", f"agentserve.gateway.*{small_limits.port}"], capture_output=True, text=True)
    assert "--tokenize-inline-bytes 1024 --max-tokenizing-bytes 4096" in out.stdout, out.stdout
