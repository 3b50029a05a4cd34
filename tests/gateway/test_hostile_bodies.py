"""Hostile request bodies over HTTP: whatever a client POSTs, the gateway answers a 2xx or a typed error in OpenAI's
shape with a 4xx status, never a 5xx (but 503 ``busy``); a stream ends with ``data: [DONE]``, after at most one error
event; nothing is logged with a traceback or at ERROR; the server keeps serving.  The ZeroMQ ingress has its own
(tests/ingress/test_hostile_input.py).

Bodies come from the shape of the request structs (gateway/schemas.py), half of them hostile (any field with a value
of the right type out of range, or null, or any JSON value; lone surrogates, unknown roles and content parts, odd tool
calls and tools, unknown fields) and half valid, where only what a valid request may hold is odd (strings, tool
schemas, tool-call arguments, tool-call tags in content) so that they reach the model, streams, tool-call parsing and
grammars: a valid body must be answered, or refused for a documented limit only.  Then bytes that are not a JSON object
(truncated, deep, huge numbers, invalid UTF-8, duplicate keys, another Content-Type) and bodies cut off on the wire.

Every valid output bound is small (a long one, or a long default, is replaced) so that an example is one short turn.
"""

from __future__ import annotations

import json
import math
import socket
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

ERROR_STATUSES = {400, 404, 413}  # and 503 with code `busy`: the only server-side answer a client may see
MAX_INT64 = 2**63 - 1
FUZZ = settings(deadline=None, print_blob=True, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much, HealthCheck.large_base_example])

# ---- checking an answer ----------------------------------------------------------------------------


def check_error(error: Any, status: int) -> None:
    """``{"message", "type", "param", "code"}`` with a message and a type; a 5xx only as 503 ``busy``."""
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error
    if status >= 500 or error["type"] == "server_error":
        assert status == 503 and error["code"] == "busy", (status, error)


def check_stream(text: str, obj: str) -> None:
    """``data: <json>`` events, at most one error and only as the last, then ``data: [DONE]``."""
    events = text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]", text[-500:]
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2] if e.startswith("data: ")]
    assert len(payloads) == len(events) - 2, text[-500:]  # nothing but data events
    for i, p in enumerate(payloads):
        if "error" in p:
            assert i == len(payloads) - 1 and set(p) == {"error"}, p
            check_error(p["error"], 503 if p["error"]["code"] == "busy" else 400)  # never a server error
        else:
            assert p["object"] == obj and isinstance(p["choices"], list), p


def post(client: httpx.Client, path: str, content: bytes, content_type: str | None = "application/json"
         ) -> tuple[int, dict[str, Any] | None]:
    """POST ``content``, read the answer to its end and check its shape; the status and the error, if any."""
    headers = {"content-type": content_type} if content_type else {}
    with client.stream("POST", path, content=content, headers=headers) as r:
        text = r.read().decode()
    status, kind = r.status_code, r.headers.get("content-type", "")
    if status == 200:
        obj = {"/v1/chat/completions": "chat.completion", "/v1/completions": "text_completion"}.get(path)
        if kind.startswith("text/event-stream"):
            assert obj is not None, path
            check_stream(text, obj + ".chunk" if obj == "chat.completion" else obj)
        else:
            body = json.loads(text)
            assert isinstance(body, dict), text
            if obj is not None:
                assert body["object"] == obj and body["choices"], text
        return status, None
    assert status in ERROR_STATUSES or status == 503, (status, text)
    assert kind.startswith("application/json"), (status, kind, text)
    body = json.loads(text)
    assert isinstance(body, dict) and set(body) == {"error"}, text
    check_error(body["error"], status)
    return status, body["error"]


class Watch:
    """The server's log since the fuzzer started: no traceback, no ERROR record."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.seen = len(server.logs())

    def check(self) -> None:
        logs = self.server.logs()
        new, self.seen = logs[self.seen:], len(logs)
        bad = [line for line in new.splitlines() if "Traceback" in line or "level=ERROR" in line
               or "level=CRITICAL" in line]
        assert not bad, "\n".join(bad)[-4000:]


@pytest.fixture(scope="module")
def watch(http_server) -> Watch:
    return Watch(http_server)


@pytest.fixture(scope="module")
def client(http_server):
    with httpx.Client(base_url=http_server.url, headers=http_server.headers(), timeout=120) as c:
        yield c


DEEP = "\x01deep"  # a string written as an array nested 3000 deep (a value hypothesis could not print)


# what may refuse a valid request: the server's own limits, and a tool or response schema its grammar cannot take
VALID_REFUSALS = ("context_length_exceeded", "limit_exceeded")
GRAMMAR = ("grammar", "schema")


def send(client: httpx.Client, watch: Watch, path: str, case: tuple[bool, Any], utf8: bool = False) -> int:
    """``case`` (hostile?, body) as JSON: non-ASCII escaped, or raw UTF-8 where lone surrogates become invalid bytes.
    A valid body is answered or refused for a documented limit only."""
    hostile, body = case
    data = (json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass") if utf8
            else json.dumps(body).encode())
    data = data.replace(json.dumps(DEEP).encode(), b"[" * 3000 + b"]" * 3000)
    status, error = post(client, path, data)
    event(f"{path} {'hostile' if hostile else 'valid'} {status}")
    watch.check()
    if not hostile and error is not None:
        assert error["code"] in VALID_REFUSALS or (
            error["code"] == "invalid_request" and any(w in error["message"] for w in GRAMMAR)), (status, error)
    return status


# ---- values ----------------------------------------------------------------------------------------

ODD_TEXT = ["", "\x00", "\u202e", "🙂", "é" * 3, "<tool_call>", "</tool_call>", "<|python_tag|>", "<|im_start|>",
            "<|im_end|>", '<tool_call>{"name": "f", "arguments": {}}</tool_call>', "{{ raise_exception('x') }}",
            "{% for %}", "\\", '"', "null", "x" * 3000]
TEXT = st.one_of(st.text(max_size=12), st.sampled_from(ODD_TEXT),
                 st.text(st.characters(categories=["Co", "Cc", "Zl", "So"]), max_size=6))
STRINGS = st.one_of(TEXT, st.sampled_from([DEEP, "\ud800", "a\udfffb"]),  # lone surrogates: not JSON text
                    st.text(st.characters(codec=None, categories=["Cs"]), min_size=1, max_size=3))
ODD_INTS = [0, -1, 2**31, MAX_INT64, 2**63, -(2**63), -(2**63) - 1, 2**64 - 1, 2**64, 10**30, 10**400]
INTS = st.one_of(st.integers(-3, 40), st.sampled_from(ODD_INTS))
FLOATS = st.one_of(st.floats(allow_nan=False, allow_infinity=False),
                   st.sampled_from([0.0, -0.0, 0.5, 1.0, 2.0, 1e-320, 1e308, -1e308]))


def json_values(strings: st.SearchStrategy, ints: st.SearchStrategy) -> st.SearchStrategy:
    scalars = st.one_of(st.none(), st.booleans(), ints, FLOATS, strings)
    return st.recursive(scalars, lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(strings, c, max_size=4)),
                        max_leaves=10)


ANY = json_values(STRINGS, INTS)
VALUES = json_values(TEXT, st.integers(-(2**63), MAX_INT64))  # what a JSON decoder takes
ODD = st.one_of(st.none(), ANY)
NOT_JSON = st.sampled_from([math.inf, -math.inf, math.nan])  # json.dumps writes Infinity, NaN
USER = {"role": "user", "content": "hi"}


def with_content(message: dict[str, Any]) -> dict[str, Any]:
    """A valid message has content (an empty one where it was left out), unless it is an assistant's with tool
    calls."""
    if message["role"] == "assistant" and message.get("tool_calls"):
        return message
    return {"content": "", **message}


def weighted(*choices: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """A value of one of the strategies, chosen in proportion to its weight."""
    return st.sampled_from([s for weight, s in choices for _ in range(weight)]).flatmap(lambda s: s)


class Shapes:
    """The request bodies' strategies.  ``hostile``: any field may hold a value of its type out of range, and one in
    twenty nested values (and up to two top-level fields) a null or any JSON value; otherwise every field is in
    range and only what a valid request may hold is odd (strings, tool schemas, tool-call arguments, the model's
    tool-call tags in content), so the examples reach the model, streaming, tool-call parsing and grammars."""

    def __init__(self, hostile: bool) -> None:
        self.hostile = hostile
        self.text = STRINGS if hostile else TEXT
        self.any = ANY if hostile else VALUES
        names = st.sampled_from(["f", "g", "get_weather"])
        self.names = self.pick(names, STRINGS)
        objects = st.dictionaries(self.text, self.any, max_size=3)
        arguments = st.one_of(
            objects.map(json.dumps), objects, self.text,
            st.sampled_from(['{"a": 1', '{"a": ' + "9" * 5000 + "}", "[" * 3000 + "]" * 3000, '{"a": NaN}', "{}",
                             "[1]", '{"a": {"b": [' * 200 + "1" + "]}}" * 200 + "}"]))
        tool_call = self.mostly(st.fixed_dictionaries(
            {"function": self.mostly(st.fixed_dictionaries({"name": self.names}, optional={"arguments": arguments}))},
            optional={"id": self.mostly(self.text), "type": self.mostly(self.pick(st.just("function"), STRINGS))}))
        text_part = st.fixed_dictionaries({"type": st.just("text"), "text": self.text})
        part = self.pick(text_part, st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "image_url", "input_audio", "refusal", "file"])},
            optional={"text": self.any, "image_url": self.any, "refusal": self.text}))
        content = self.mostly(weighted((2, self.text), (1, st.lists(part, max_size=3))))

        def message(role: st.SearchStrategy, **optional: st.SearchStrategy) -> st.SearchStrategy:
            made = self.mostly(st.fixed_dictionaries({"role": role}, optional={
                "content": content, "name": self.mostly(self.text), "x": self.any} | optional))
            return made if hostile else made.map(with_content)

        roles = [
            (4, message(st.sampled_from(["system", "developer", "user"]))),
            (3, message(st.just("assistant"), tool_calls=self.mostly(st.lists(tool_call, max_size=3)),
                        refusal=self.mostly(self.text))),
            (2, message(st.just("tool"), tool_call_id=self.mostly(self.text))),
        ]
        if hostile:
            odd_role = st.one_of(st.sampled_from(["function", "", "USER", "ipython", "wizard"]), ANY)
            roles.append((1, message(odd_role, tool_calls=self.mostly(st.lists(tool_call, max_size=2)))))
        self.message = weighted(*roles)
        self.messages = weighted(
            (6, st.lists(self.message, max_size=4).map(lambda ms: [*ms, USER])),
            (3 if hostile else 0, st.lists(self.message, min_size=1, max_size=4)),
            (1 if hostile else 0, st.sampled_from([[], [USER] * 4097, [{"role": "user", "content": "word " * 5000}],
                                                   [{"role": "user", "content": [DEEP]}]])))
        values = st.one_of(SCHEMA_VALUES, self.any)
        self.schema = st.recursive(
            st.dictionaries(st.sampled_from(SCHEMA_KEYS), values, max_size=3),
            lambda c: st.one_of(
                st.fixed_dictionaries({"type": st.just("object"),
                                       "properties": st.dictionaries(self.text, c, max_size=3)},
                                      optional={"required": st.lists(self.text, max_size=2)}),
                st.fixed_dictionaries({"type": st.just("array"), "items": c}),
                st.fixed_dictionaries({"anyOf": st.lists(c, max_size=3)}),
                st.fixed_dictionaries({"$defs": st.fixed_dictionaries({"a": c}), "$ref": st.just("#/$defs/a")}),
                st.dictionaries(st.sampled_from(SCHEMA_KEYS), st.one_of(c, values), max_size=3)),
            max_leaves=8)
        tool = self.mostly(st.fixed_dictionaries(
            {"function": self.mostly(st.fixed_dictionaries({"name": self.names}, optional={
                "description": self.mostly(self.text), "parameters": self.mostly(self.schema),
                "strict": self.mostly(st.booleans())}))},
            optional={"type": self.mostly(self.pick(st.just("function"), STRINGS))}))
        many = st.just([{"function": {"name": f"f{i}"}} for i in range(300)])
        self.tools = weighted((9, st.lists(tool, max_size=3)), (1 if hostile else 0, many))
        unique = st.lists(tool, max_size=3, unique_by=lambda t: t["function"]["name"])
        self.unique_tools = self.tools if hostile else unique
        self.unknown = st.dictionaries(st.sampled_from(["user", "metadata", "store", "reasoning_effort", "x",
                                                        "functions", "modalities", "service_tier", "$.x", ""]),
                                       self.any, max_size=2)

    def pick(self, valid: st.SearchStrategy, odd: st.SearchStrategy) -> st.SearchStrategy:
        """``valid``; hostile, one time in three ``odd`` (a value of the right type out of range)."""
        return weighted((2, valid), (1, odd)) if self.hostile else valid

    def mostly(self, valid: st.SearchStrategy) -> st.SearchStrategy:
        """``valid``; hostile, one time in twenty a null or any JSON value instead."""
        return weighted((19, valid), (1, ODD)) if self.hostile else valid


SCHEMA_KEYS = ["type", "properties", "items", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "required",
               "additionalProperties", "minimum", "maximum", "minLength", "maxLength", "pattern", "format",
               "minItems", "maxItems", "not", "if", "then", "prefixItems", "description"]
SCHEMA_VALUES = st.one_of(
    st.sampled_from(["object", "string", "integer", "number", "boolean", "array", "null", "nope"]),
    st.lists(st.sampled_from(["string", "integer", "null", "x"]), max_size=3),
    st.sampled_from(["#", "#/$defs/a", "#/nope", "http://example.com/s.json", "^a+$", "(", "a{2,1}", "[z-a]",
                     "(a|b)*c", "\\p{L}+", "a{0,2000}", "date-time", "email", "uuid"]))


SEEDS = st.one_of(st.integers(0, MAX_INT64), st.integers(MAX_INT64 - 2, MAX_INT64))  # the top: with n > 1 too


def sampling(s: Shapes) -> dict[str, st.SearchStrategy]:
    unit = st.floats(0, 1, exclude_min=True)
    return {
        "model": s.pick(st.sampled_from(["tiny", None]), STRINGS), "stream": st.booleans(),
        "max_tokens": s.pick(st.integers(1, 4), INTS), "temperature": s.pick(st.floats(0, 2), FLOATS),
        "top_p": s.pick(unit, FLOATS), "top_k": s.pick(st.integers(-1, 50), INTS),
        "min_p": s.pick(st.floats(0, 1), FLOATS), "seed": s.pick(SEEDS, INTS),
        "ignore_eos": st.booleans(), "n": s.pick(st.integers(1, 3), INTS),
        "stop": s.pick(st.one_of(st.text(min_size=1, max_size=4), st.lists(st.text(min_size=1), max_size=4)),
                       st.one_of(STRINGS, st.lists(STRINGS, max_size=20))),
        "frequency_penalty": s.pick(st.just(0), FLOATS), "presence_penalty": s.pick(st.just(0.0), FLOATS),
        "repetition_penalty": s.pick(st.just(1.0), FLOATS),
        "logit_bias": s.pick(st.just({}), st.dictionaries(STRINGS, FLOATS, max_size=2)),
    }


def bodies(s: Shapes, required: dict[str, st.SearchStrategy], optional: dict[str, st.SearchStrategy],
           default_length: int | None = None) -> st.SearchStrategy:
    """Bodies of ``s``'s fields with unknown ones; hostile, up to two fields (known or not) set to a null or any
    JSON value.  Where the output bound asked for (or the default) is valid and long, it is 3: a short turn."""
    names = st.sampled_from([*required, *optional, "x"])
    mutations = st.lists(st.tuples(names, weighted((20, ODD), (1, NOT_JSON))), max_size=2 if s.hostile else 0)
    return st.tuples(st.fixed_dictionaries(required, optional=optional), mutations, s.unknown).map(
        lambda t: short(t[2] | t[0] | dict(t[1]), default_length))


def short(body: dict[str, Any], default: int | None) -> dict[str, Any]:
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    length = body.get(key, default)
    if length is None or (type(length) is int and 8 < length <= MAX_INT64):
        body[key] = 3
    return body


def consistent(body: dict[str, Any]) -> dict[str, Any]:
    """A valid chat request: ``stream_options`` only when it streams, ``top_logprobs`` with ``logprobs``, a
    ``tool_choice`` other than none or auto with tools (a named one among them), a ``json_schema`` response format
    with its ``json_schema``."""
    if body.get("stream") is True:
        body.setdefault("stream_options", {"include_usage": True})
    if body.get("top_logprobs"):
        body["logprobs"] = True
    fmt, choice, tools = body.get("response_format"), body.get("tool_choice"), body.get("tools")
    if fmt is not None and fmt["type"] == "json_schema":
        fmt.setdefault("json_schema", {})
    if choice not in (None, "none", "auto"):
        if not tools:
            del body["tool_choice"]
        elif isinstance(choice, dict):
            choice["function"]["name"] = tools[0]["function"]["name"]
    return body


def chat(s: Shapes) -> st.SearchStrategy:
    choice = st.one_of(st.sampled_from(["none", "auto", "required"]), st.fixed_dictionaries(
        {"type": s.mostly(st.just("function")), "function": s.mostly(st.fixed_dictionaries({"name": s.names}))}))
    response_format = st.fixed_dictionaries(
        {"type": s.mostly(st.sampled_from(["text", "json_object", "json_schema"]))},
        optional={"json_schema": s.mostly(st.fixed_dictionaries({}, optional={
            "name": s.mostly(s.text), "schema": s.mostly(s.schema), "strict": s.mostly(st.booleans()),
            "description": s.mostly(s.text)}))})
    fields = sampling(s) | {
        "max_completion_tokens": s.pick(st.integers(1, 4), INTS), "tools": s.unique_tools,
        "tool_choice": s.pick(choice, STRINGS), "parallel_tool_calls": st.booleans(),
        "logprobs": s.pick(st.just(True), INTS), "top_logprobs": s.pick(st.integers(0, 20), INTS),
        "response_format": response_format}
    if s.hostile:
        fields["stream_options"] = st.fixed_dictionaries({}, optional={"include_usage": s.mostly(st.booleans())})
    return bodies(s, {"messages": s.messages}, fields).map(consistent if not s.hostile else lambda b: b)


def completion(s: Shapes) -> st.SearchStrategy:
    ids = st.lists(st.integers(0, 319), min_size=1, max_size=12)
    prompts = s.pick(st.one_of(TEXT.filter(bool), ids),
                     st.one_of(STRINGS, st.lists(INTS, max_size=4), st.lists(STRINGS, max_size=2),
                               st.just([[1, 2], [3]])))
    fields = sampling(s) | {
        "logprobs": s.pick(st.integers(0, 20), INTS), "echo": s.pick(st.just(False), st.booleans()),
        "best_of": s.pick(st.just(1), INTS), "suffix": s.pick(st.just(""), STRINGS), "return_token_ids": st.booleans()}
    fields["n"] = s.pick(st.just(1), INTS)
    return bodies(s, {"prompt": prompts}, fields, default_length=16)


def tokenize(s: Shapes) -> st.SearchStrategy:
    either = st.one_of(st.fixed_dictionaries({"prompt": s.text}),
                       st.fixed_dictionaries({"messages": s.messages}, optional={"tools": s.tools}))
    extra = {"model": s.pick(st.just("tiny"), STRINGS), "add_special_tokens": st.booleans(),
             "add_generation_prompt": st.booleans()}
    if s.hostile:
        extra |= {"prompt": STRINGS, "messages": s.messages, "tools": s.tools}
    return st.tuples(either, bodies(s, {}, extra)).map(lambda t: t[0] | t[1])


def detokenize(s: Shapes) -> st.SearchStrategy:
    tokens = s.pick(st.lists(st.integers(0, 319), max_size=12), st.lists(INTS, max_size=4))
    return bodies(s, {"tokens": tokens}, {"model": s.pick(st.just("tiny"), STRINGS)})


VALID, HOSTILE = Shapes(hostile=False), Shapes(hostile=True)


def cases(shape: Any) -> st.SearchStrategy:
    """(hostile?, body): valid and hostile bodies half and half."""
    return st.one_of(shape(VALID).map(lambda b: (False, b)), shape(HOSTILE).map(lambda b: (True, b)))


CHAT, COMPLETION, TOKENIZE, DETOKENIZE = cases(chat), cases(completion), cases(tokenize), cases(detokenize)


# ---- the fuzzers -----------------------------------------------------------------------------------


@settings(FUZZ, max_examples=150)
@given(case=CHAT, utf8=st.booleans())
def test_chat_completions_answers_every_body_with_a_result_or_a_typed_error(client, watch, case, utf8):
    send(client, watch, "/v1/chat/completions", case, utf8)


@settings(FUZZ, max_examples=80)
@given(case=COMPLETION, utf8=st.booleans())
def test_completions_answers_every_body_with_a_result_or_a_typed_error(client, watch, case, utf8):
    send(client, watch, "/v1/completions", case, utf8)


@settings(FUZZ, max_examples=80)
@given(case=TOKENIZE, utf8=st.booleans())
def test_tokenize_answers_every_body_with_a_result_or_a_typed_error(client, watch, case, utf8):
    send(client, watch, "/tokenize", case, utf8)


@settings(FUZZ, max_examples=40)
@given(case=DETOKENIZE)
def test_detokenize_answers_every_body_with_a_result_or_a_typed_error(client, watch, case):
    send(client, watch, "/detokenize", case)


# ---- bytes that are not a JSON object ----------------------------------------------------------------

PATHS = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"]
GOOD = {"/v1/chat/completions": {"messages": [USER], "max_tokens": 2, "stream": True},
        "/v1/completions": {"prompt": "hi", "max_tokens": 2, "stream": True},
        "/tokenize": {"messages": [USER]}, "/detokenize": {"tokens": [1, 2]}}
RAW = [b"", b" ", b"{", b"}", b"null", b"true", b"1", b"-0", b'"x"', b"[]", b"{}", b"{nope", b"\x00", b"\xff\xfe{}",
       b"\xef\xbb\xbf{}", b"{'messages': []}", b'{"a": 1,}', b"{} {}", b"NaN", b"1e999", b"9" * 10000,
       b"[" * 100_000, b"{\"a\":" * 50_000, b'{"messages": "\xed\xa0\x80"}', b'{"tokens": [' + b"9" * 5000 + b"]}",
       b'{"prompt": "\\ud800"}', b'{"prompt": "\\udc00\\ud800"}', b'{"prompt": "\\u00"}', b'{"\\ud800": 1}']


@settings(FUZZ, max_examples=60)
@given(path=st.sampled_from(PATHS), data=st.one_of(st.sampled_from(RAW), st.binary(max_size=40)))
def test_bytes_that_are_not_a_json_object_are_400(client, watch, path, data):
    assert post(client, path, data)[0] == 400
    watch.check()


@settings(FUZZ, max_examples=40)
@given(path=st.sampled_from(PATHS), cut=st.floats(0, 1, exclude_max=True), junk=st.binary(max_size=4))
def test_truncated_bodies_are_400(client, watch, path, cut, junk):
    data = json.dumps(GOOD[path]).encode()
    data = data[:int(cut * len(data))] + junk
    try:
        json.loads(data)  # the junk may close it again: `{"tokens": [1, 2` + `]}`
    except ValueError:
        assert post(client, path, data)[0] == 400
    else:
        post(client, path, data)
    watch.check()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/json; charset=latin-1"])
def test_other_content_types_are_read_as_json(client, watch, path, content_type):
    """The body is JSON whatever the header says (OpenAI and vLLM do not look at it either)."""
    assert post(client, path, json.dumps(GOOD[path]).encode(), content_type)[0] == 200
    watch.check()


@pytest.mark.parametrize("path", PATHS)
def test_duplicate_keys_are_each_checked_and_the_last_is_taken(client, watch, path):
    good = json.dumps(GOOD[path])
    key = next(iter(GOOD[path]))
    assert post(client, path, (f'{{"{key}": 5, ' + good[1:]).encode())[0] == 400
    assert post(client, path, (good[:-1] + f', "{key}": 5}}').encode())[0] == 400
    assert post(client, path, (good[:-1] + f', "{key}": {json.dumps(GOOD[path][key])}}}').encode())[0] == 200
    watch.check()


DEEP_ARRAY = "[" * 20_000 + "]" * 20_000


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("where", ["array", "object", "unknown field"])
def test_deep_nesting_is_400(client, watch, path, where):
    data = {"array": DEEP_ARRAY, "object": '{"a":' * 20_000 + "1" + "}" * 20_000,
            "unknown field": json.dumps(GOOD[path])[:-1] + ', "unknown": ' + DEEP_ARRAY + "}"}[where]
    assert post(client, path, data.encode())[0] == 400
    watch.check()


@settings(FUZZ, max_examples=16)
@given(path=st.sampled_from(PATHS), cut=st.floats(0, 1, exclude_max=True), chunked=st.booleans())
def test_a_body_cut_off_on_the_wire_is_a_499_never_read(http_server, watch, path, cut, chunked):
    """The client closes the connection before its body is whole: nothing to answer, nothing to log."""
    data = json.dumps(GOOD[path]).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {http_server.api_key}\r\n"
            f"Content-Type: application/json\r\n")
    head += (f"Transfer-Encoding: chunked\r\n\r\n{len(data):x}\r\n" if chunked
             else f"Content-Length: {len(data)}\r\n\r\n")
    before = http_server.answered(path)
    with socket.create_connection(("127.0.0.1", http_server.port)) as s:
        s.sendall(head.encode() + data[:int(cut * len(data))])
    assert http_server.answered_once(path, before) == {"499": 1}
    watch.check()


def test_a_body_streamed_past_the_bound_without_a_length_is_413(client, watch):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(9):
            yield b"x" * 2**20
        yield b'"}'

    with client.stream("POST", "/v1/completions", content=chunks()) as r:
        r.read()
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    watch.check()


def test_the_server_is_healthy_and_logged_nothing_after_the_fuzzing(http_server, client, watch):
    assert httpx.get(http_server.url + "/health", timeout=10).status_code == 200
    r = client.post("/v1/chat/completions", json={"messages": [USER], "max_tokens": 2})
    assert r.status_code == 200, r.text
    watch.check()
