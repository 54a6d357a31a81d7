"""N-gram (prompt lookup) proposer: hand-made cases and a property test against brute force."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.spec.proposers import NgramProposer, Proposal


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, literally: longest n first, then the latest earlier start."""
    if k <= 0:
        return []
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def propose(tokens: list[int], k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    proposal = NgramProposer(min_n, max_n).propose(tokens, k)
    assert proposal.probs is None  # point mass
    return proposal.tokens


def test_longest_n_wins_over_more_recent_shorter_match() -> None:
    # suffix [1,2,3]: the 3-gram occurs at 0 (followed by 7, 8); the 1-gram "3" occurs later at 6
    # (followed by 9). The longer match wins.
    seq = [1, 2, 3, 7, 8, 5, 3, 9, 1, 2, 3]
    assert propose(seq, 2) == [7, 8]
    assert propose(seq, 2, max_n=1) == [9, 1]


def test_most_recent_occurrence() -> None:
    seq = [4, 5, 10, 4, 5, 11, 4, 5]
    assert propose(seq, 1) == [11]


def test_k_cap_and_short_tail() -> None:
    seq = [1, 2, 3, 4, 5, 6, 1, 2]
    assert propose(seq, 3) == [3, 4, 5]
    assert propose(seq, 100) == [3, 4, 5, 6, 1, 2]
    assert propose(seq, 0) == []


def test_overlapping_occurrence_in_a_run() -> None:
    # [7,7,7,7]: the 3-gram suffix also starts at 0 and is followed by the last 7.
    assert propose([7, 7, 7, 7], 4) == [7]


def test_no_match_gives_empty() -> None:
    assert propose([1, 2, 3, 4], 3) == []
    assert propose([], 3) == []
    assert propose([5], 3) == []
    # a 1-gram match exists but min_n=2 excludes it
    assert propose([1, 2, 9, 2], 3, min_n=2) == []
    assert propose([1, 2, 9, 2], 3, min_n=1) == [9, 2]


def test_batch_interface_matches_single() -> None:
    proposer = NgramProposer(1, 3)
    batch = [[1, 2, 1], [3, 3], [4, 5, 6]]
    assert proposer.propose_batch(batch, [2, 1, 5]) == [
        Proposal([2, 1]),
        Proposal([3]),
        Proposal([]),
    ]


def test_rejects_bad_range() -> None:
    with pytest.raises(ValueError):
        NgramProposer(0, 2)
    with pytest.raises(ValueError):
        NgramProposer(3, 2)


def test_long_sequence_matches_brute_force() -> None:
    seq = [(i * 7919) % 97 for i in range(5000)] + [3, 1, 4, 1, 5] * 3
    assert propose(seq, 5) == brute_force(seq, 5, 1, 4)
    assert NgramProposer().propose(np.asarray(seq, dtype=np.int64), 5).tokens == propose(seq, 5)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=40),
    k=st.integers(0, 6),
    bounds=st.tuples(st.integers(1, 5), st.integers(0, 3)),
)
def test_matches_brute_force(tokens: list[int], k: int, bounds: tuple[int, int]) -> None:
    min_n, extra = bounds
    assert propose(tokens, k, min_n, min_n + extra) == brute_force(tokens, k, min_n, min_n + extra)
