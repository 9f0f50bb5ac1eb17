"""The prompt-lookup drafter and greedy verification."""

from __future__ import annotations

import pytest

from app.mla.speculative import NgramDrafter, accept_greedy


def test_the_drafter_continues_the_most_recent_longest_match() -> None:
    drafter = NgramDrafter(3, min_ngram=1, max_ngram=3)
    index = drafter.new_index([5, 6, 7, 8, 1, 6, 7, 9, 4, 6, 7])
    # suffix (6, 7): most recent earlier occurrence is followed by 9, 4, 6
    assert drafter.propose(index) == [9, 4, 6]
    index.extend([9])
    # suffix (6, 7, 9) occurred once, followed by 4, 6, 7
    assert drafter.propose(index) == [4, 6, 7]


def test_a_continuation_running_into_the_present_repeats_the_pattern() -> None:
    drafter = NgramDrafter(5, max_ngram=2)
    index = drafter.new_index([1, 2, 3, 1, 2, 3, 1, 2])
    assert drafter.propose(index) == [3, 1, 2, 3, 1]


def test_no_match_repeats_the_last_token() -> None:
    drafter = NgramDrafter(4)
    assert drafter.propose(drafter.new_index([1, 2, 3])) == [3, 3, 3, 3]
    assert drafter.propose(drafter.new_index([7])) == [7, 7, 7, 7]


def test_greedy_acceptance() -> None:
    assert accept_greedy([4, 5, 6], [4, 5, 6, 7]) == (3, [4, 5, 6, 7])
    assert accept_greedy([4, 9, 6], [4, 5, 6, 7]) == (1, [4, 5])
    assert accept_greedy([9, 5, 6], [4, 5, 6, 7]) == (0, [4])
    assert accept_greedy([], [3]) == (0, [3])
    with pytest.raises(ValueError, match="need 3 greedy tokens"):
        accept_greedy([1, 2], [1, 2])


def test_bad_drafter_settings() -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramDrafter(0)
    with pytest.raises(ValueError, match="max_ngram"):
        NgramDrafter(2, min_ngram=3, max_ngram=2)
