"""scripts/example_agent.py runs its ReAct loop against the echo server (which "calls" the tool)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "scripts" / "example_agent.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("example_agent", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_calculator_tool(example):
    assert example.calc("17 * (3 + 4)") == "119"
    assert example.calc("2 ** 10 / 4") == "256.0"
    assert example.calc("__import__('os')").startswith("error")
    assert example.calc("1/0").startswith("error")


def test_react_loop_calls_the_tool_and_answers_with_its_result(example, server, capsys):
    # the echo "model" answers "CALL <expr>" with a calc tool call, and echoes the tool result after
    answer = example.run_agent("CALL 17 * (3 + 4)", server.endpoint)
    assert answer == "119"
    assert "[tool] calc({'expr': '17 * (3 + 4)'}) -> 119" in capsys.readouterr().out
    (first, second) = server.turn_requests
    assert second.messages[0].role == "tool" and second.messages[0].content == "119"


def test_react_loop_without_tool_calls_returns_the_text(example, server):
    assert example.run_agent("plain answer", server.endpoint, echo=False) == "plain answer"
