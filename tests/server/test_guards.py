"""The loop's last-resort guard, and large prompts built off the loop.

An unexpected exception while handling one request or streaming one turn ends that turn with
``internal`` and the server goes on; an exception from the scheduler (a broken invariant) ends every
turn with ``internal`` and stops the server cleanly.  A turn with a very large text is tokenised on the
worker thread, so other sessions are served meanwhile; aborting or closing it while it is prepared works.
"""

from __future__ import annotations

import threading
import time

import pytest
from server_harness import TOKEN, serving, wait_until

from agentserve.client import AgentClient, InternalError, LimitExceeded, PromptTooLong, ServerBusy
from agentserve.orchestrator.conversation import Conversation
from agentserve.orchestrator.limits import ClientRules, ServingLimits
from agentserve.orchestrator.running_turn import RunningTurn
from agentserve.orchestrator.scheduler.config import SchedulerConfig
from agentserve.orchestrator.server import ServerBroken, ServerOptions

SMALL_INLINE = ServerOptions(
    "agentserve", SchedulerConfig(), limits=ServingLimits(clients=ClientRules(tokenize_inline_bytes=1024))
)


@pytest.fixture()
def served(tmp_path):
    with serving(tmp_path, options=SMALL_INLINE) as parts:
        yield parts


def test_an_exception_while_streaming_a_turn_ends_only_that_turn(served, monkeypatch) -> None:
    endpoint, _, server = served
    real = RunningTurn.on_token
    calls = {"n": 0}

    def flaky(self, token_id, t, *logprobs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("detokenizer bug")
        return real(self, token_id, t, *logprobs)

    monkeypatch.setattr(RunningTurn, "on_token", flaky)
    with AgentClient(endpoint) as client, client.session(system="sys") as s, client.session(system="x") as other:
        with pytest.raises(InternalError, match="detokenizer bug"):
            s.turn("hello", max_tokens=4, ignore_eos=True).collect()
        assert s.turn("again", max_tokens=3, ignore_eos=True).collect().token_ids == [TOKEN] * 3
        assert other.turn("hi", max_tokens=2, ignore_eos=True).collect().token_ids == [TOKEN] * 2


def test_an_exception_handling_a_request_answers_internal_and_the_session_goes_on(served, monkeypatch) -> None:
    endpoint, _, _ = served
    real = Conversation.prompt_for
    monkeypatch.setattr(Conversation, "prompt_for", lambda self, turn: {}["boom"])  # a KeyError, not ValueError
    with AgentClient(endpoint) as client, client.session(system="sys") as s:
        with pytest.raises(InternalError, match="KeyError"):
            s.turn("hello", max_tokens=2).collect()
        monkeypatch.setattr(Conversation, "prompt_for", real)
        assert s.turn("hello", max_tokens=2, ignore_eos=True).collect().token_ids == [TOKEN] * 2


def test_a_broken_scheduler_invariant_ends_every_turn_and_stops_the_server(tmp_path, monkeypatch) -> None:
    with serving(tmp_path) as (endpoint, link, server), AgentClient(endpoint) as client:
        s = client.session(system="sys")
        s.turn("warm", max_tokens=1).collect()

        def broken(msg):
            raise AssertionError("block table out of sync")

        monkeypatch.setattr(server.sched, "on_result", broken)
        with pytest.raises(InternalError, match="block table out of sync"):
            s.turn("hello", max_tokens=4, ignore_eos=True).collect()
        wait_until(lambda: isinstance(getattr(server, "raised", None), ServerBroken))


def test_a_huge_prompt_is_tokenised_off_the_loop_while_others_are_served(served) -> None:
    """The big turn's text (2 MB, ~2 s to tokenise here) is over the context, so it ends in ``prompt_too_long``
    — but only after another session's turn was served from start to end."""
    endpoint, _, _ = served
    times: dict[str, float] = {}
    big_text = "word " * 400_000

    def big_turn() -> None:
        with AgentClient(endpoint) as client, client.session() as s:
            try:
                s.turn(big_text, max_tokens=2).collect()
            except PromptTooLong:
                times["big"] = time.monotonic()

    with AgentClient(endpoint) as client, client.session(system="sys") as s:
        s.turn("warm", max_tokens=1).collect()
        big = threading.Thread(target=big_turn)
        big.start()
        time.sleep(0.3)  # the big turn is with the worker
        assert s.turn("quick", max_tokens=3, ignore_eos=True).collect().token_ids == [TOKEN] * 3
        times["small"] = time.monotonic()
        big.join(60)
    assert "big" in times and times["small"] < times["big"]


def test_a_turn_being_prepared_can_be_aborted_and_its_client_can_vanish(served) -> None:
    endpoint, _, server = served
    with AgentClient(endpoint) as client:
        s = client.session()
        stream = s.turn("word " * 400_000, max_tokens=2)
        wait_until(lambda: any(r.preparing for r in server.sessions.values()))
        stream.abort()
        assert stream.collect().finish == "abort"
        with AgentClient(endpoint) as leaving:
            doomed = leaving.session()
            doomed.turn("word " * 400_000, max_tokens=2)
            wait_until(lambda: len(server.sessions) == 2 and any(r.preparing for r in server.sessions.values()))
        wait_until(lambda: len(server.sessions) == 1, timeout=15)  # its session went with it
        wait_until(lambda: server.worker.pending == 0, timeout=30)  # the late prompt was dropped
        assert s.turn("after", max_tokens=2, ignore_eos=True).collect().token_ids == [TOKEN] * 2


def test_a_connection_holds_at_most_max_sessions(tmp_path) -> None:
    """Sessions cost memory until closed: one connection may hold ``max_sessions`` (those still being opened on
    the worker thread count); the next open is ``limit_exceeded``, other connections are not affected, and
    closing one makes room again."""
    rules = ClientRules(tokenize_inline_bytes=1024, max_sessions=2)
    options = ServerOptions("agentserve", SchedulerConfig(), limits=ServingLimits(clients=rules))
    with serving(tmp_path, options=options) as (endpoint, _, _), AgentClient(endpoint) as client, \
            AgentClient(endpoint) as other:
        first = client.session(system="x" * 4096)  # rendered on the worker thread
        client.session(system="sys")
        with pytest.raises(LimitExceeded, match="limits.clients.max_sessions"):
            client.session(system="one too many")
        other.session(system="another connection").close()
        first.close()
        client.session(system="room again").close()


def test_text_waiting_for_the_worker_thread_is_bounded_per_connection(tmp_path, monkeypatch) -> None:
    """Large prompts queue for the one worker thread; one connection's waiting text is bounded, so a client cannot
    pile up gigabytes there (the next is ``busy``, to retry); other connections are not affected."""
    rules = ClientRules(tokenize_inline_bytes=1024, max_tokenizing_bytes=5000)
    options = ServerOptions("agentserve", SchedulerConfig(), limits=ServingLimits(clients=rules))
    gate, real = threading.Event(), Conversation.prompt_for

    def held_back(self, turn):
        gate.wait(30)
        return real(self, turn)

    monkeypatch.setattr(Conversation, "prompt_for", held_back)
    with serving(tmp_path, options=options) as (endpoint, _, _), AgentClient(endpoint) as client, \
            AgentClient(endpoint) as other:
        first, second = client.session(), client.session()
        waiting = first.turn("x" * 3000, max_tokens=1, ignore_eos=True)  # held on the worker thread
        with pytest.raises(ServerBusy, match="limits.clients.max_tokenizing_bytes"):
            second.turn("y" * 3000, max_tokens=1, ignore_eos=True).collect()
        elsewhere = other.session().turn("z" * 3000, max_tokens=1, ignore_eos=True)
        gate.set()
        assert waiting.collect().token_ids == [TOKEN] and elsewhere.collect().token_ids == [TOKEN]
        assert second.turn("y" * 3000, max_tokens=1, ignore_eos=True).collect().token_ids == [TOKEN]
