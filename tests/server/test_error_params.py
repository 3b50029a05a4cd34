"""A refusal the server loop decides (the prompt's length, token ids against the vocabulary, the constraint's
grammar) names the request field at fault in its ``param``, in OpenAI's terms, as the client SDK receives it."""

from __future__ import annotations

import pytest
from server_harness import serving

from agentserve.client import AgentClient, AgentServeError, InvalidRequest, PromptTooLong
from agentserve.protocol.client_messages import Constraint

TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {
    "x": {"$ref": "#/$defs/missing"}}}}}]


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("params")) as (endpoint, _, _):
        yield endpoint


@pytest.mark.parametrize(
    ("turn", "error", "param"),
    [
        ({"messages": "word " * 10_000}, PromptTooLong, "messages"),  # OpenAI's context_length_exceeded names it
        ({"token_ids": [1] * 10_000}, PromptTooLong, "prompt"),  # a raw-token turn is /v1/completions' prompt
        ({"token_ids": [1, 40_000]}, InvalidRequest, "prompt"),  # past the vocabulary
        ({"messages": "x", "constraint": Constraint(json_schema='{"$ref": "#/$defs/missing"}')}, InvalidRequest,
         "response_format"),
        ({"messages": "x", "constraint": Constraint(tool_choice="calc")}, InvalidRequest, "tools"),
        ({"messages": "x", "constraint": Constraint(tool_choice="nope")}, InvalidRequest, "tool_choice"),
        ({"messages": "x", "constraint": Constraint(json_schema="{}", tool_choice="calc")}, InvalidRequest, "tools"),
        ({"messages": "x", "constraint": Constraint(tool_choice="required", allowed_tools=("nope",))}, InvalidRequest,
         "tool_choice"),
    ],
    ids=["chat-too-long", "raw-too-long", "vocabulary", "schema", "tool-schema", "tool-choice", "forced-beside-schema",
         "allowed-unknown"],
)
def test_the_loops_refusals_name_the_field(endpoint, turn: dict, error: type[AgentServeError], param: str) -> None:
    with AgentClient(endpoint) as client, client.session(tools=TOOLS) as s:
        messages = turn.pop("messages", None)
        with pytest.raises(error) as e:
            s.turn(messages, max_tokens=2, **turn).collect()
    assert e.value.param == param, e.value
