"""A ReAct agent in 40 lines: the model reasons, calls a calculator tool, reads the result, answers.

    agentserve up --model PATH/TO/Qwen2.5-0.5B-Instruct &
    python scripts/example_agent.py "What is 17 * (3 + 4)?"

The server keeps the session's KV between turns, so each step sends only what is new: the tool's
result.  (With ``--model tiny`` the weights are random: the loop runs, the answers are noise.)
"""

from __future__ import annotations

import argparse
import ast
import operator

from agentserve.client import AgentClient, TextDelta

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression, e.g. '17 * (3 + 4)'.",
        "parameters": {
            "type": "object",
            "properties": {"expr": {"type": "string", "description": "the expression"}},
            "required": ["expr"],
        },
    },
}

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}  # fmt: skip


def calc(expr: str) -> str:
    """The fake tool: safe arithmetic (numbers and + - * / ** only)."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression: {expr!r}")

    try:
        return str(ev(ast.parse(expr, mode="eval").body))
    except (ValueError, SyntaxError, ZeroDivisionError) as e:
        return f"error: {e}"


def run_agent(question: str, endpoint: str | None = None, max_steps: int = 5, echo: bool = True) -> str:
    """Ask, let the model call tools until it answers; return the final answer text."""
    system = "You are a careful assistant. Use the calc tool for any arithmetic, then answer briefly."
    with AgentClient(endpoint) as client, client.session(system=system, tools=[CALCULATOR]) as session:
        turn = session.turn(question, max_tokens=256)
        for _ in range(max_steps):
            for event in turn:
                if echo and isinstance(event, TextDelta):
                    print(event.text, end="", flush=True)
            result = turn.result
            if not result.tool_calls:
                return result.text
            for call in result.tool_calls:
                output = calc(str(call.arguments.get("expr", "")))
                if echo:
                    print(f"\n[tool] {call.name}({call.arguments}) -> {output}")
                session.tool_result(call.id, output, name=call.name)
            turn = session.turn(max_tokens=256)  # resume: sends just the tool results
        return turn.collect().text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("question", nargs="?", default="What is 17 * (3 + 4)?")
    ap.add_argument("--endpoint", default=None, help="default: the local `agentserve up` socket")
    ap.add_argument("--max-steps", type=int, default=5)
    args = ap.parse_args()
    answer = run_agent(args.question, args.endpoint, args.max_steps)
    print(f"\n=> {answer}")


if __name__ == "__main__":
    main()
