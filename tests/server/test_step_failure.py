"""A failed executor step reaches the client as ``executor_failed`` — not as an abort it never asked for —
and the session goes on: the scheduler hears that the turn ended and the next turn is served."""

from __future__ import annotations

import pytest
from server_harness import TOKEN, serving

from agentserve.client import AgentClient
from agentserve.client.errors import ExecutorFailed


@pytest.fixture()
def served(tmp_path):
    with serving(tmp_path) as parts:
        yield parts


def test_a_failed_step_ends_the_turn_with_executor_failed_and_the_session_goes_on(served) -> None:
    endpoint, link, server = served
    with AgentClient(endpoint) as client, client.session(system="sys") as s:
        first = s.turn("hello", max_tokens=3, ignore_eos=True).collect()
        assert first.token_ids == [TOKEN] * 3
        link.failing = True
        with pytest.raises(ExecutorFailed, match="injected failure"):
            s.turn("this one fails", max_tokens=3, ignore_eos=True).collect()
        link.failing = False
        again = s.turn("and this one works", max_tokens=2, ignore_eos=True).collect()
        assert again.token_ids == [TOKEN] * 2 and again.done is not None
    assert link.failed_steps, "the failing turn reached the executor"
    assert server.sched.counters["failed"] == 1 and server.sched.counters["aborted"] == 0
    assert not server.sched.ended, "the scheduler was told the failed turn ended"


def test_each_failed_turn_is_told_its_own_failure(served) -> None:
    """A step that failed on the executor, then a result without the token it owed: each turn gets its own
    reason (not the last executor message)."""
    endpoint, link, server = served
    with AgentClient(endpoint) as client, client.session(system="sys") as s:
        link.failing = True
        with pytest.raises(ExecutorFailed, match="injected failure"):
            s.turn("fails on the executor", max_tokens=3, ignore_eos=True).collect()
        link.failing, link.tokenless = False, True
        with pytest.raises(ExecutorFailed, match="returned no token") as lost:
            s.turn("gets no token", max_tokens=3, ignore_eos=True).collect()
        assert "injected" not in str(lost.value)
    assert server.sched.counters["failed"] == 2


def test_a_turn_a_stop_string_completed_ends_normally_though_a_step_queued_behind_fails(served) -> None:
    """Tokens A, B, C, ...; the stop string "B" completes the turn at its 2nd token while the decode plan
    queued behind (it would sample the 3rd) fails: the turn's text is whole, so it ends with TurnDone."""
    endpoint, link, _ = served
    link.counting, link.fail_from = True, 3
    with AgentClient(endpoint) as client, client.session(system="sys") as s:
        got = s.turn("spell", max_tokens=8, ignore_eos=True, stop=["B"]).collect()
        assert got.text == "A" and got.done is not None and got.done.finish == "stop"
    assert link.failed_steps, "the plan queued behind the stop was sent and failed"


def test_a_grammar_larger_than_a_step_carries_is_invalid_request(served) -> None:
    """A JSON schema within its character bound can compile to a grammar larger than a ring slot (CJK text is three
    bytes a character): refused up front, never sent (it once stopped the server)."""
    import json

    from agentserve.client import InvalidRequest
    from agentserve.protocol.client_messages import Constraint

    schema = {"type": "object", "properties": {f"键{i}" + "名" * 2000: {"type": "string"} for i in range(10)}}
    endpoint, _, _ = served
    with AgentClient(endpoint) as client, client.session(system="sys") as s:
        with pytest.raises(InvalidRequest, match="grammar is .* bytes"):
            constraint = Constraint(json_schema=json.dumps(schema, ensure_ascii=False))
            s.turn("fill it", max_tokens=4, constraint=constraint).collect()
        assert s.turn("still here", max_tokens=2, ignore_eos=True).collect().token_ids == [TOKEN] * 2


def test_a_plan_no_ring_slot_holds_fails_its_turns_and_the_server_goes_on(served, monkeypatch) -> None:
    from agentserve.protocol.ring_messages import Plan
    from agentserve.shm.errors import MessageTooLarge

    endpoint, link, server = served
    real = link.send
    refused: list[int] = []

    def send(msg: object) -> None:
        if isinstance(msg, Plan) and not refused:
            refused.append(msg.step)
            raise MessageTooLarge(200_000, 131_072)
        real(msg)

    monkeypatch.setattr(link, "send", send)
    with AgentClient(endpoint) as client, client.session(system="sys") as s:
        with pytest.raises(ExecutorFailed, match="too large to send"):
            s.turn("hello", max_tokens=3, ignore_eos=True).collect()
        assert s.turn("again", max_tokens=2, ignore_eos=True).collect().token_ids == [TOKEN] * 2
    assert refused and server.sched.counters["failed"] == 1
