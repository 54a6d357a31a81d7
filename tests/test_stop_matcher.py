"""Incremental stop-string matching against a brute-force reference: the earliest completed stop string,
and the longest suffix of the text that could still become one (the text held back from clients)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.stop_matcher import StopMatcher, failure_table


def held_back_reference(text: str, stops: list[str]) -> int:
    return max((k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)


def first_match_reference(text: str, stops: list[str]) -> tuple[int, str] | None:
    """(start, stop) of the stop string that ends first in text; of those ending together, the longest."""
    found = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
    if not found:
        return None
    end, minus_length, stop = min(found)
    return end + minus_length, stop


@settings(max_examples=400, deadline=None)
@given(
    stops=st.lists(st.text("abc", min_size=1, max_size=6), min_size=1, max_size=4),
    deltas=st.lists(st.text("abcd", max_size=4), max_size=25),
)
def test_matches_the_brute_force_reference(stops: list[str], deltas: list[str]) -> None:
    matcher = StopMatcher(stops, [failure_table(s) for s in stops])
    text = ""
    for delta in deltas:
        start, text = len(text), text + delta
        hit = matcher.feed(text, start)
        expected = first_match_reference(text, stops)
        if expected is not None:
            assert hit is not None and (hit[0], stops[hit[1]]) == expected
            return
        assert hit is None
        assert matcher.held_back == held_back_reference(text, stops)


def test_failure_table() -> None:
    assert failure_table("aabaaab") == [0, 1, 0, 1, 2, 2, 3]
