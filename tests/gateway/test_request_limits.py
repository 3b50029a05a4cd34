"""The gateway checks the request limits the server announces (its ``configs/limits.toml``, with ``--config``
overrides), not numbers of its own: one source for each bound, and text over ``max_text_bytes`` is refused before
the gateway tokenises it (megabytes take seconds of a worker thread)."""

from __future__ import annotations

import os
import subprocess

import httpx
import pytest

from agentserve.gateway.backend import Backend, GatewayOptions
from agentserve.gateway.limits import check_prompt_text
from agentserve.protocol.limits import Limits
from tests.gateway.conftest import HttpServer

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
    assert http.post(path, json=body).status_code == 200


def test_a_prompt_over_the_text_bound_is_refused_before_it_is_tokenised() -> None:
    """A backend with no tokenizer at all: the refusal cannot have tokenised anything."""
    limits = Limits(max_text_bytes=8)
    check_prompt_text("12345678", limits)
    with pytest.raises(Exception, match="limits.request.max_text_bytes") as e:
        check_prompt_text("123456789", limits)
    assert getattr(e.value, "status", None) == 400


def test_until_the_server_announces_its_limits_the_gateway_holds_the_defaults() -> None:
    assert Backend(GatewayOptions(endpoint="ipc:///unused")).limits == Limits()
    assert Limits.announced({}) == Limits()
    assert Limits.announced({"max_messages": 7, "a_limit_of_a_newer_server": 1}) == Limits(max_messages=7)


def test_the_server_announces_its_request_limits(small_limits: HttpServer) -> None:
    from agentserve.client import AgentClient

    with AgentClient(small_limits.endpoint) as client:
        announced = Limits.announced(client.server.limits)
    assert (announced.max_messages, announced.max_text_bytes, announced.max_stop_strings) == (3, 2048, 2)


def test_up_gives_the_gateway_its_clients_bounds(small_limits: HttpServer) -> None:
    """``[clients]`` of ``up --config`` reaches the gateway's tokenising lanes."""
    out = subprocess.run(["pgrep", "-af", f"agentserve.gateway.*{small_limits.port}"], capture_output=True, text=True)
    assert "--tokenize-inline-bytes 1024 --max-tokenizing-bytes 4096" in out.stdout, out.stdout
