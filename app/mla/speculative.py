"""Speculative decoding with a prompt-lookup (n-gram) drafter, and greedy verification.

``NgramDrafter`` proposes ``k`` tokens from a request's own history (prompt and generated
tokens): it finds the most recent earlier occurrence of the history's last ``n`` tokens (longest
``n`` first, ``max_ngram`` down to ``min_ngram``) and proposes the ``k`` tokens that followed it
(a continuation that runs into the present repeats the pattern). With no match it proposes the
last token ``k`` times: a wrong draft is only rejected, and every decode step keeps the uniform
query length ``k + 1`` the decode backends need.

``accept_greedy`` is the verification: the step ran the last token and the ``k`` drafts; row
``i``'s greedy token is what the plain decoder would emit after draft ``i``. The longest prefix
of drafts equal to those choices is accepted, plus the next greedy token, so the output is
exactly the plain greedy run's (up to near-ties, where rounding may pick either token).
"""

from __future__ import annotations

from collections.abc import Sequence

from app._validation import check_int_at_least

__all__ = ["NgramDrafter", "NgramIndex", "accept_greedy"]


class NgramIndex:
    """The n-grams of one token history and where each last occurred (with a continuation).

    ``extend`` appends tokens; ``propose`` drafts from the current suffix. Updating costs
    ``O(max_ngram)`` per token, proposing ``O(max_ngram + k)``.
    """

    __slots__ = ("_last", "max_ngram", "min_ngram", "tokens")

    def __init__(self, min_ngram: int, max_ngram: int) -> None:
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        # n-gram -> index just past its most recent occurrence that has a following token.
        self._last: dict[tuple[int, ...], int] = {}

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append tokens to the history."""
        tokens, last = self.tokens, self._last
        for token in token_ids:
            end = len(tokens)  # the n-grams ending here now get a continuation: ``token``
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                last[tuple(tokens[end - n:end])] = end
            tokens.append(int(token))

    def propose(self, k: int) -> list[int]:
        """``k`` draft tokens (the last token repeated when no n-gram matches)."""
        tokens = self.tokens
        length = len(tokens)
        for n in range(min(self.max_ngram, length), self.min_ngram - 1, -1):
            start = self._last.get(tuple(tokens[length - n:]))
            if start is not None:
                draft: list[int] = []
                for i in range(k):
                    pos = start + i
                    draft.append(tokens[pos] if pos < length else draft[pos - length])
                return draft
        return [tokens[-1]] * k if tokens else [0] * k


class NgramDrafter:
    """Prompt-lookup drafting of ``num_speculative_tokens`` tokens (n-grams of ``min_ngram``
    to ``max_ngram`` tokens). ``new_index`` makes a request's history index."""

    def __init__(self, num_speculative_tokens: int, min_ngram: int = 1,
                 max_ngram: int = 3) -> None:
        check_int_at_least("NgramDrafter: num_speculative_tokens", num_speculative_tokens, 1)
        check_int_at_least("NgramDrafter: min_ngram", min_ngram, 1)
        check_int_at_least("NgramDrafter: max_ngram", max_ngram, min_ngram)
        self.num_speculative_tokens = num_speculative_tokens
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram

    def new_index(self, token_ids: Sequence[int]) -> NgramIndex:
        """The index of a history (a request's prompt)."""
        index = NgramIndex(self.min_ngram, self.max_ngram)
        index.extend(token_ids)
        return index

    def propose(self, index: NgramIndex) -> list[int]:
        """``num_speculative_tokens`` drafts for the history in ``index``."""
        return index.propose(self.num_speculative_tokens)


def accept_greedy(drafts: Sequence[int], greedy: Sequence[int]) -> tuple[int, list[int]]:
    """Verify ``drafts`` (k tokens) against ``greedy`` (k + 1 choices: row ``i`` is the greedy
    token after the last token and drafts ``< i``). Returns the number of accepted drafts ``j``
    and the tokens to emit: ``drafts[:j] + [greedy[j]]``."""
    if len(greedy) != len(drafts) + 1:
        raise ValueError(f"accept_greedy: {len(drafts)} drafts need {len(drafts) + 1} greedy "
                         f"tokens, got {len(greedy)}")
    j = 0
    while j < len(drafts) and drafts[j] == greedy[j]:
        j += 1
    return j, [*drafts[:j], greedy[j]]
