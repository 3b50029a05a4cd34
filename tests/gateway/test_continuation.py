"""Stateless clients keep the AgentServe advantage: a resent conversation continues its session."""

from __future__ import annotations

import pytest

SYSTEM = {"role": "system", "content": "You are an agent."}


def _turns(snapshot) -> tuple[int, int]:
    return len(snapshot.sessions), sum(row.turn for row in snapshot.sessions)


@pytest.mark.parametrize("system", [[SYSTEM], [{"role": "system", "content": ""}], []], ids=["system", "empty", "none"])
def test_a_resent_conversation_is_a_turn_on_the_same_session(openai_client, http_server, system) -> None:
    """An empty system message counts as one of the messages the session holds (it once shifted the count by
    one: the first new message was dropped, or the turn refused for having none)."""
    first = [*system, {"role": "user", "content": "Plan the trip."}]
    r1 = openai_client.chat.completions.create(model="tiny", messages=first, max_tokens=6, temperature=0)
    sessions, turns = _turns(http_server.snapshot())
    reply = {"role": "assistant", "content": r1.choices[0].message.content}
    second = [*first, reply, {"role": "user", "content": "And then?"}]
    r2 = openai_client.chat.completions.create(model="tiny", messages=second, max_tokens=6, temperature=0)
    assert _turns(http_server.snapshot()) == (sessions, turns + 1), "no new session: one more turn on the old one"
    # The earlier conversation (prompt and reply) is still in the KV cache, reused in whole 16-token blocks.
    held = r1.usage.prompt_tokens + r1.usage.completion_tokens
    assert r2.usage.prompt_tokens > held and r2.usage.prompt_tokens_details.cached_tokens >= held // 16 * 16


def test_an_edited_history_starts_a_new_session(openai_client, http_server) -> None:
    first = [SYSTEM, {"role": "user", "content": "Count."}]
    r1 = openai_client.chat.completions.create(model="tiny", messages=first, max_tokens=4, temperature=0)
    sessions, _ = _turns(http_server.snapshot())
    edited = {"role": "assistant", "content": r1.choices[0].message.content + " (edited)"}
    openai_client.chat.completions.create(model="tiny", messages=[*first, edited, {"role": "user", "content": "go"}],
                                          max_tokens=4, temperature=0)
    assert _turns(http_server.snapshot())[0] == sessions + 1
