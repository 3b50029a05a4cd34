"""Stop strings across token boundaries, streamed and one-shot."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentserve.orchestrator.running_turn import RunningTurn
from agentserve.orchestrator.text.stop_strings import StopStringMatcher, find_stop
from agentserve.orchestrator.text.tokenization import Tokenizer
from agentserve.protocol.client_messages import FinishReason, ToolCallEvent
from agentserve.protocol.sampling import Finish


def feed_all(matcher: StopStringMatcher, pieces: list[str]) -> tuple[str, bool]:
    out = ""
    for p in pieces:
        m = matcher.feed(p)
        out += m.text
        if m.stopped:
            return out, True
    tail = matcher.flush()
    return out + tail, matcher.stopped


def test_stop_split_across_deltas():
    m = StopStringMatcher(["</end>"])
    assert m.feed("hello </e").text == "hello "  # "</e" is held back
    r = m.feed("nd> tail")
    assert (r.text, r.stopped, r.stop, r.truncate_at) == ("", True, "</end>", 6)


def test_held_text_released_when_it_diverges():
    m = StopStringMatcher(["STOP"])
    assert m.feed("ab ST").text == "ab "
    assert m.feed("ale").text == "STale"
    assert m.flush() == ""


def test_earliest_of_several_stops_wins_and_include_stop():
    m = StopStringMatcher(["yz", "x"], include_stop=True)
    r = m.feed("abcxyz")
    assert (r.text, r.stop, r.truncate_at) == ("abcx", "x", 4)
    assert m.feed("more").text == ""


def test_a_stop_that_starts_earlier_wins_even_when_a_later_one_completes_first():
    m = StopStringMatcher(["O", "POO"])
    assert (m.feed("PO").text, m.stopped) == ("", False)  # "PO" may still become "POO"
    r = m.feed("O")
    assert (r.text, r.stopped, r.stop) == ("", True, "POO")
    m = StopStringMatcher(["O", "POO"])
    m.feed("PO")
    r = m.feed("x")
    assert (r.text, r.stopped, r.stop) == ("P", True, "O")  # diverged: the complete "O" stops it
    m = StopStringMatcher(["O", "POO"])
    m.feed("PO")
    assert (m.flush(), m.stopped) == ("P", True)  # the stream ends: "O" was complete


def test_find_stop_with_new_chars():
    assert find_stop("aa STOP bb", ["STOP"]) == ("STOP", 3)
    assert find_stop("aa STOP bb", ["STOP"], new_chars=2) is None  # the match ended before the new text
    assert find_stop("aa STOP", ["STOP"], new_chars=1) == ("STOP", 3)
    assert find_stop("abc", ["", "zz"]) is None


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abcS TOP", max_size=40),
    stops=st.lists(st.text(alphabet="abcS TOP", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=8),
    include_stop=st.booleans(),
)
def test_streaming_equals_one_shot(text, stops, cuts, include_stop):
    """However the text is split into deltas, the output is the text up to the first stop (with it, for
    ``include_stop``)."""
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    out, stopped = feed_all(StopStringMatcher(stops, include_stop=include_stop), pieces)
    hit = find_stop(text, stops)
    assert stopped == (hit is not None)
    end = None if hit is None else hit[1] + (len(hit[0]) if include_stop else 0)
    assert out == text[:end]


def test_at_the_same_start_the_stop_listed_first_wins_when_it_completes_later():
    m = StopStringMatcher(["abc", "ab"], include_stop=True)
    assert m.feed("ab").text == ""  # "ab" is complete, but "abc" (listed first) may still follow
    r = m.feed("c")
    assert (r.text, r.stop) == ("abc", "abc")


def test_a_turn_cut_at_a_stop_found_only_when_it_ends_finishes_with_stop(tiny_dir):
    """At the end of a stream the held-back text is searched too: its stop string cuts the text and
    the turn finishes with ``stop``, not ``length``."""
    tok = Tokenizer.from_dir(tiny_dir)
    turn = RunningTurn(1, 1, 1, tok, ["O", "POO"], frozenset(), False, 0.0, [], [])
    for token_id in tok.encode("xPO", add_special_tokens=False):
        turn.on_token(token_id, 0.0)
    assert turn.text == "x", "'PO' is held: it may still become 'POO'"
    *_, done = turn.finish(Finish.LENGTH, 1.0, 0)
    assert turn.text == "xP" and done.finish == FinishReason.STOP


@pytest.mark.parametrize(("reason", "expected"),
                         [(Finish.LENGTH, FinishReason.LENGTH), (Finish.STOP, FinishReason.TOOL_CALLS)])
def test_a_turn_max_tokens_cut_inside_its_tool_calls_finishes_with_length(tiny_dir, reason, expected):
    """The calls written so far are still reported, but a client must see that max_tokens ended the reply (the
    last call may be cut short), as OpenAI's and the docs' ``length`` says."""
    tok = Tokenizer.from_dir(tiny_dir)
    turn = RunningTurn(1, 1, 1, tok, [], frozenset(), True, 0.0, [], [])
    for token_id in tok.encode('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "ar',
                               add_special_tokens=False):
        turn.on_token(token_id, 0.0)
    *calls, done = turn.finish(reason, 1.0, 0)
    assert [c.name for c in calls if isinstance(c, ToolCallEvent)] == ["a"]
    assert done.finish == expected
