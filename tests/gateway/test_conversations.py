"""The conversation map: longest filed prefix, one holder per session, bounded, idle sessions closed."""

from __future__ import annotations

from agentserve.gateway.conversations import ConversationMap, chain
from agentserve.gateway.messages import Canonical

U1, A1, T1, U2 = (Canonical("user", "q"), Canonical("assistant", "", tool_calls=(("c1", "f", "{}"),)),
                  Canonical("tool", "42", tool_call_id="c1"), Canonical("user", "thanks"))


def test_the_longest_filed_prefix_is_taken_once() -> None:
    closed: list[str] = []
    m = ConversationMap(on_evict=closed.append)
    m.file(chain(b"seed", [U1, A1])[-1], "s1")
    digests = chain(b"seed", [U1, A1, T1])
    assert m.take(digests) == ("s1", 2)
    assert m.take(digests) is None, "a session runs one turn at a time: taken out while it runs"
    m.file(chain(b"seed", [U1, A1, T1, Canonical("assistant", "done")])[-1], "s1")
    assert m.take(chain(b"seed", [U1, A1, T1, Canonical("assistant", "done"), U2])) == ("s1", 4)
    assert closed == []


def test_other_tools_or_a_changed_reply_do_not_match() -> None:
    m = ConversationMap()
    m.file(chain(b"seed", [U1, A1])[-1], "s1")
    assert m.take(chain(b"other tools", [U1, A1, T1])) is None
    assert m.take(chain(b"seed", [U1, Canonical("assistant", "edited"), T1])) is None
    assert m.take(chain(b"seed", [U1, A1])) is None, "nothing new to send: not a continuation"


def test_capacity_and_idle_eviction_close_sessions() -> None:
    now = [0.0]
    closed: list[str] = []
    m = ConversationMap(capacity=2, idle_s=10.0, clock=lambda: now[0], on_evict=closed.append)
    for i in range(3):
        m.file(chain(b"s", [Canonical("user", str(i))])[-1], f"s{i}")
        now[0] += 4.0
    assert closed == ["s0"] and len(m) == 2
    now[0] = 15.0  # s1 (filed at 4) has been idle for 11 s, s2 (filed at 8) for 7 s
    assert m.sweep() == 1 and closed == ["s0", "s1"]
    m.file(chain(b"s", [Canonical("user", "2")])[-1], "s9")  # the same conversation filed again: newest wins
    assert closed == ["s0", "s1", "s2"] and m.drain() == ["s9"]


def test_idle_completion_sessions_are_closed_too() -> None:
    """The raw-token map (``/v1/completions``) closes its idle sessions like the chat map (they stayed until the
    capacity pushed them out)."""
    from agentserve.gateway.token_conversations import TokenConversationMap

    now, closed = [0.0], []
    m = TokenConversationMap(8, idle_s=600.0, clock=lambda: now[0], on_evict=closed.append)
    m.file([1, 2, 3], "s0")
    now[0] = 400.0
    m.file([4, 5], "s1")
    now[0] = 700.0
    assert m.sweep() == 1 and closed == ["s0"] and len(m) == 1
    assert m.take([4, 5, 6]) == ("s1", 2) and m.sweep() == 0
