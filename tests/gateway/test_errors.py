"""Bad input is a 4xx with an OpenAI-shaped body (the SDKs retry 5xx), and the server keeps serving."""

from __future__ import annotations

import json
import socket

import openai
import pytest

OK = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    return body


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"max_tokens": 3}, None),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": "hi"}, "messages"),
        (OK | {"temperature": -1}, "temperature"),
        (OK | {"top_p": 0}, "top_p"),
        (OK | {"max_tokens": 0}, "max_tokens"),
        (OK | {"n": 0}, "n"),
        (OK | {"stop": [""]}, "stop"),
        (OK | {"seed": -3}, "seed"),
        (OK | {"tool_choice": "required"}, "tool_choice"),
        (OK | {"tool_choice": "sometimes"}, "tool_choice"),
        (OK | {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages[0].content[0]"),
        (OK | {"max_tokens": 2**64}, "max_tokens"),
        (OK | {"stream_options": {"include_usage": True}}, "stream_options"),  # without stream: true
        (OK | {"presence_penalty": 0.5}, "presence_penalty"),  # would change what is sampled: not ignored
        (OK | {"frequency_penalty": -1}, "frequency_penalty"),
        (OK | {"logit_bias": {"5": -100}}, "logit_bias"),
    ],
)
def test_invalid_fields_are_400(http, body, param) -> None:
    err = _error(http.post("/v1/chat/completions", json=body), 400)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param


_TOOLS = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(257)]


@pytest.mark.parametrize(
    ("path", "body", "param", "code"),
    [
        ("/v1/chat/completions", OK | {"temperature": -0.5}, "temperature", "invalid_sampling"),
        ("/v1/chat/completions", OK | {"min_p": 2}, "min_p", "invalid_sampling"),
        ("/v1/chat/completions", OK | {"seed": 2**63}, "seed", "invalid_sampling"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "top_p": 1.5}, "top_p", "invalid_sampling"),
        ("/v1/chat/completions", OK | {"stop": ["x" * 257]}, "stop", "limit_exceeded"),  # limits.request.max_stop_bytes
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": ["é" * 129]}, "stop", "limit_exceeded"),
        ("/v1/chat/completions", OK | {"tools": _TOOLS}, "tools", "limit_exceeded"),  # limits.request.max_tools
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 6000}], "max_tokens": 2},
         "messages", "context_length_exceeded"),
        ("/v1/completions", {"prompt": [1] * 5000, "max_tokens": 2}, "prompt", "context_length_exceeded"),
        ("/v1/completions", {"prompt": "word " * 6000, "max_tokens": 2}, "prompt", "context_length_exceeded"),
        ("/v1/chat/completions", OK | {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"$ref": "#/$defs/missing"}}}}, "response_format", "invalid_request"),
    ],
    ids=["temperature", "min_p", "seed", "completions-top_p", "stop-bytes", "completions-stop-bytes", "tools",
         "chat-too-long", "completions-too-long", "completions-text-too-long", "schema"],
)
def test_the_orchestrators_refusals_name_the_request_field(http, path, body, param, code) -> None:
    """What only the orchestrator judges (sampling ranges, its limits, the context, the grammar) comes back as a
    400 whose ``param`` names the field, as OpenAI's do, not only its message."""
    err = _error(http.post(path, json=body), 400)
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error"), err


def test_bad_json_too_long_prompt_unknown_model_and_route(http) -> None:
    _error(http.post("/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"}), 400)
    long = {"messages": [{"role": "user", "content": "word " * 6000}], "max_tokens": 2}
    assert _error(http.post("/v1/chat/completions", json=long), 400)["code"] == "context_length_exceeded"
    assert _error(http.post("/v1/chat/completions", json=OK | {"model": "gpt-5"}), 404)["param"] == "model"
    _error(http.get("/v1/no/such/route"), 404)


@pytest.mark.parametrize("body, says", [
    (b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', "escape without its pair"),  # read "truncated"
    (b'{"messages": [{"role": "user", "content": "a', "truncated"),
])
def test_a_body_that_is_no_json_says_why(http, body, says) -> None:
    err = _error(http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"}), 400)
    assert err["code"] == "invalid_json" and says in err["message"], err


@pytest.mark.parametrize("part", [{"type": "text"}, {"type": "text", "text": 5}])
def test_a_text_part_without_its_text_says_so(http, part) -> None:
    """A text part without a string `text` is not refused as if it were an image ("got type 'text'")."""
    body = OK | {"messages": [{"role": "user", "content": [part]}]}
    error = _error(http.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == "messages[0].content[0].text" and "`text`" in error["message"]


_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize("content", [{"content": None}, {}], ids=["null", "missing"])
@pytest.mark.parametrize("role", ["user", "system", "developer", "tool", "assistant"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_a_message_without_content_is_400_naming_it(http, path, role, content) -> None:
    """OpenAI refuses a message whose content is null or missing (an assistant's without tool_calls too); it was
    read as empty text and answered."""
    messages = [{"role": "user", "content": "hi"}, {"role": role, "tool_call_id": "c1", **content},
                {"role": "user", "content": "go on"}]
    err = _error(http.post(path, json=OK | {"messages": messages}), 400)
    assert (err["param"], err["type"]) == ("messages[1].content", "invalid_request_error"), err
    assert f"{role} message" in err["message"]


def test_an_assistant_message_with_tool_calls_may_have_null_content(http) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [_CALL]},
                {"role": "tool", "tool_call_id": "c1", "content": "done"}]
    assert http.post("/v1/chat/completions", json=OK | {"messages": messages}).status_code == 200
    assert http.post("/tokenize", json={"messages": messages}).status_code == 200


def _tools(*names: str) -> list[dict]:
    return [{"type": "function", "function": {"name": name}} for name in names]


@pytest.mark.parametrize("name", ['get"weather', "f</tool_call>", "f" * 129, "", "f\n", "a b", "f'g", "f\\g", "f{}"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_a_function_name_that_could_change_the_prompt_is_400_naming_its_tool(http, path, name) -> None:
    """A quote, a tag or a line break in a name went into the prompt as sent (so did 129 characters, past MCP's
    limit)."""
    err = _error(http.post(path, json=OK | {"tools": _tools("ok", name)}), 400)
    assert (err["param"], err["type"]) == ("tools[1].function.name", "invalid_request_error"), err


def test_function_names_within_the_pattern_are_served_and_tool_choice_must_name_one(http) -> None:
    """The longest name and every kind of character are accepted (OpenAI's, and MCP's dotted and namespaced names);
    a named ``tool_choice`` must name one of the (checked) tools, so a refused name is refused there too, blamed on
    ``tool_choice``."""
    tools = _tools("f" * 128, "A-z_0-9", "github.create_issue", "fs:read/file", "café")
    assert http.post("/v1/chat/completions", json=OK | {"tools": tools}).status_code == 200
    choice = {"type": "function", "function": {"name": 'f"</tool_call>'}}
    err = _error(http.post("/v1/chat/completions", json=OK | {"tools": tools, "tool_choice": choice}), 400)
    assert err["param"] == "tool_choice"


def test_a_wrong_method_is_405_with_the_allowed_ones(http) -> None:
    """RFC 9110: a 405 names the methods the route takes (`Allow`), as Starlette's own answer does."""
    r = http.get("/v1/chat/completions")
    _error(r, 405)
    assert r.headers["allow"] == "POST"


def test_oversized_body_is_413(http) -> None:
    big = b'{"messages": [{"role": "user", "content": "' + b"x" * (9 * 2**20) + b'"}]}'
    _error(http.post("/v1/chat/completions", content=big, headers={"content-type": "application/json"}), 413)


def test_missing_or_wrong_api_key_is_401_but_health_is_open(http_server) -> None:
    import httpx

    assert httpx.post(http_server.url + "/v1/chat/completions", json=OK).status_code == 401
    for wrong in ("Bearer nope", f"Basic {http_server.api_key}", http_server.api_key, f"Bearer {http_server.api_key}x"):
        _error(httpx.post(http_server.url + "/v1/chat/completions", json=OK, headers={"Authorization": wrong}), 401)
    lower = {"Authorization": f"bearer {http_server.api_key}"}  # the scheme is case-insensitive (RFC 9110)
    assert httpx.post(http_server.url + "/v1/chat/completions", json=OK, headers=lower).status_code == 200
    assert httpx.get(http_server.url + "/health").status_code == 200


def test_what_completions_does_not_take_names_its_field(http) -> None:
    for field, value in (("n", 2), ("echo", True)):
        err = _error(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, field: value}), 400)
        assert err["param"] == field, err


def test_explicit_nulls_and_neutral_values_are_the_defaults(http) -> None:
    """Clients that send every field send null for the unset ones; OpenAI reads that as the default."""
    nulls = {"stream": None, "n": None, "ignore_eos": None, "stream_options": None, "logprobs": None}
    neutral = {"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}}
    r = http.post("/v1/chat/completions", json=OK | nulls | neutral)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": None, "echo": None,
                                           "best_of": 1, "suffix": None, "return_token_ids": None})
    assert r.status_code == 200 and "token_ids" not in r.json()["choices"][0], r.text
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True,
                                           "stream_options": {"include_usage": None}})
    assert r.status_code == 200 and '"usage"' not in r.text, r.text
    r = http.post("/tokenize", json={"messages": OK["messages"], "add_generation_prompt": None})
    assert r.status_code == 200, r.text
    _error(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "best_of": 3}), 400)
    _error(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "suffix": "end"}), 400)


def test_sdk_sees_typed_errors_and_the_server_keeps_serving(openai_client) -> None:
    with pytest.raises(openai.BadRequestError):
        openai_client.chat.completions.create(model="tiny", messages=[], max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        openai_client.chat.completions.create(model="nope", messages=OK["messages"], max_tokens=2)
    r = openai_client.chat.completions.create(model="tiny", messages=OK["messages"], max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")



_DEEP = "[" * 2000 + "]" * 2000


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", json.dumps(OK | {"seed": 2**64})),
        ("/v1/chat/completions", json.dumps(OK | {"top_k": 2**64})),
        ("/v1/completions", json.dumps({"prompt": [2**64], "max_tokens": 2})),
        ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 0})),
        ("/v1/chat/completions", json.dumps(OK)[:-1] + ', "deep": ' + _DEEP + "}"),
        ("/v1/chat/completions", json.dumps(OK)[:-1] + ', "tools": [{"type": "function", "function": {"name": "f", '
         '"parameters": {"type": "object", "properties": {"x": ' + '{"items": ' * 990 + "{}" + "}" * 990 + "}}}}]}"),
    ],
)
def test_out_of_range_or_too_deep_input_is_400_and_the_connection_lives(http, path, body) -> None:
    """Integers past 64 bits and deep nesting once raised OverflowError / RecursionError: a 500 that dropped the
    keep-alive connection."""
    _error(http.post(path, content=body.encode(), headers={"content-type": "application/json"}), 400)
    assert http.post("/v1/chat/completions", json=OK).status_code == 200  # the same client, the same connection


@pytest.mark.parametrize("number", ["123456789012345678901234567890", "9" * 5000])
def test_tool_call_arguments_past_64_bits_are_carried_as_floats(http, number) -> None:
    """A model's call with a huge integer, sent back as the client got it, must not break the agent's next turn."""
    body = {"messages": [
        {"role": "user", "content": "add"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "add", "arguments": '{"a": ' + number + "}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"}], "max_tokens": 2}
    assert http.post("/v1/chat/completions", json=body).status_code == 200


def test_every_server_error_code_has_its_http_answer() -> None:
    """The HTTP client's input is a 4xx; what the server side cannot do now (busy, restarting, stopping) a 503 the
    OpenAI SDKs retry; the rest (the gateway's own wire, a bug) a 500."""
    from agentserve.client.errors import _BY_CODE
    from agentserve.gateway.errors import from_client_error
    from agentserve.protocol.client_messages import ErrorCode as C

    client_side = {C.INVALID_REQUEST, C.PROMPT_TOO_LONG, C.TURN_IN_PROGRESS, C.INVALID_SAMPLING, C.LIMIT_EXCEEDED}
    retried = {C.BUSY, C.EXECUTOR_FAILED, C.SERVER_SHUTDOWN}
    assert set(_BY_CODE) == set(C)
    for code, cls in _BY_CODE.items():
        status = from_client_error(cls("x")).status
        expected = "4xx" if code in client_side else 503 if code in retried else 500
        assert (f"{status // 100}xx" if expected == "4xx" else status) == expected, code


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"])
def test_a_client_gone_before_its_body_is_whole_is_a_499_without_a_traceback(http_server, path) -> None:
    """A client that closed the connection before sending the body its Content-Length promised made reading the body
    raise ClientDisconnect out of the handler: a 500 in the metrics and two tracebacks in the log (the gateway's and
    uvicorn's) for a request nobody was waiting on."""
    before, logged = http_server.answered(path), len(http_server.logs())
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {http_server.api_key}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n")
    with socket.create_connection(("127.0.0.1", http_server.port)) as s:
        s.sendall(head.encode() + b'{"messages": [')
    assert http_server.answered_once(path, before) == {"499": 1}
    assert "Traceback" not in http_server.logs()[logged:]
