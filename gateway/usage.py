"""The ``usage`` object of OpenAI responses from the orchestrator's per-turn usage."""

from __future__ import annotations

from typing import Any

from agentserve.protocol.client_messages import Usage


def usage_object(usages: list[Usage]) -> dict[str, Any]:
    """One request's usage: the prompt counted once (every choice shares it), completions summed."""
    prompt = usages[0].prompt_tokens if usages else 0
    cached = usages[0].cached_tokens if usages else 0
    completion = sum(u.completion_tokens for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
