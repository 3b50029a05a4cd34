"""The conversation map: longest filed prefix, one holder per session, bounded, idle sessions closed."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

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


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), max_size=6), max_size=12), st.lists(st.integers(0, 3), max_size=7))
def test_the_token_map_takes_the_longest_filed_strict_prefix(filed: list[list[int]], prompt: list[int]) -> None:
    """Against the obvious search: every filed sequence that is a strict prefix of the prompt, the longest."""
    from agentserve.gateway.token_conversations import TokenConversationMap

    m = TokenConversationMap(capacity=64)
    for i, tokens in enumerate(filed):
        m.file(tokens, i)
    latest = {tuple(t): i for i, t in enumerate(filed)}  # filing the same tokens again replaces the session
    prefixes = [t for t in latest if len(t) < len(prompt) and list(t) == prompt[: len(t)]]
    expected = None if not prefixes else (latest[max(prefixes, key=len)], len(max(prefixes, key=len)))
    assert m.take(prompt) == expected
    assert len(m) == len(latest) - (expected is not None)


def test_a_token_map_lookup_hashes_the_prompt_once() -> None:
    """4,095 sessions of distinct lengths, each ending in the prompt's token at its length but parting from the
    prompt before (so no filter spares them), and one that is a prefix: one pass over the prompt, digests at every
    filed length on the way, the longest true prefix found (not one of the decoys that share its digest's end)."""
    from agentserve.gateway import token_conversations as tc

    prompt = list(range(8192))
    m = tc.TokenConversationMap()
    for n in range(3, 4098):
        m.file([*prompt[: n - 2], 9999, prompt[n - 1]], n)
    m.file(prompt[:5000], "hit")  # the map's capacity: 4,096
    passes: list[tuple[int, int]] = []
    real = tc._prefix_keys

    def counted(tokens, lengths):
        passes.append((len(tokens), len(lengths)))
        return real(tokens, lengths)

    tc._prefix_keys = counted
    try:
        assert m.take(prompt) == ("hit", 5000)
    finally:
        tc._prefix_keys = real
    assert passes == [(8192, 4096)]
