"""Prompt lookup: propose what followed the last few tokens the previous time they occurred.

Text that quotes, extracts from, edits or summarises its prompt repeats runs of it; so does code,
and so do lists and tables. For each row the drafter matches the last n tokens (n from
`max_n` down to 1) against the row's earlier tokens, prompt and output alike, and proposes the up
to k tokens that followed the latest earlier occurrence. It needs no model and costs a dictionary
lookup per row and step: each row keeps, for every n, the position that followed the latest
occurrence of every n-gram, extended incrementally as the row grows.
"""

from __future__ import annotations

from typing import Sequence

from worker.engines.speculation.drafter import DraftRow

# Longest suffix matched. Longer matches predict better but occur less; 3 down to 1 finds a match
# wherever the text repeats anything, and adaptivity (adaptive.py) stops rows whose matches miss.
MAX_N = 3


class _RowIndex:
    """For one row: for n in 1..max_n, n-gram -> the position right after its latest occurrence
    whose continuation is known (that position is inside the row's tokens)."""

    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        self.clear()

    def clear(self) -> None:
        self.latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(self.max_n + 1)]
        self.indexed = 0  # positions p < indexed have had the n-grams ending before p recorded
        self.tokens: list[int] = []
        self.matched = 0  # the length of the suffix the latest proposal continues (0: none matched)

    def extend(self, tokens: Sequence[int]) -> None:
        """Take the row's tokens now (the ones seen before are, as a rule, a prefix of them: a row's
        tokens only grow, so the ends of what was indexed are checked rather than all of it, which
        would cost a copy a row and step; a stale index would only cost proposals, never tokens)."""
        tokens = tokens if isinstance(tokens, list) else list(tokens)
        seen = self.indexed
        if seen and (len(tokens) < seen or tokens[0] != self.tokens[0] or tokens[seen - 1] != self.tokens[seen - 1]):
            self.clear()  # not an extension of what was indexed: start over
        self.tokens = tokens
        # Record the n-grams ending right before p, for every p whose token (the continuation) exists,
        # except the last position: the suffix matched there is the one being looked up.
        last = len(self.tokens) - 1
        for p in range(max(self.indexed, 1), last):
            for n in range(1, len(self.latest)):
                if p - n < 0:
                    break
                self.latest[n][tuple(self.tokens[p - n:p])] = p
        self.indexed = max(self.indexed, last)

    def propose(self, k: int) -> list[int]:
        tokens = self.tokens
        for n in range(len(self.latest) - 1, 0, -1):
            if len(tokens) < n + 1:
                continue
            start = self.latest[n].get(tuple(tokens[-n:]))
            if start is not None:
                self.matched = n
                return tokens[start:start + k]
        self.matched = 0
        return []


class NgramDrafter:
    """The prompt-lookup drafter (`--speculative ngram`)."""

    name = "ngram"
    judged_as_a_whole = False  # a chat that hits nothing says nothing of the next request's prompt
    guesses_first_token = False
    graded = True  # by the length of the match
    kv_bytes_per_token = 0

    def __init__(self, max_n: int = MAX_N) -> None:
        self._max_n = max_n
        self._rows: dict[str, _RowIndex] = {}

    def share_kv_budget(self, budget_bytes: int) -> None:
        pass  # it keeps no keys or values

    def propose(self, rows: Sequence[DraftRow]) -> list[list[int]]:
        proposals = []
        for row in rows:
            index = self._rows.get(row.uid)
            if index is None:
                index = self._rows[row.uid] = _RowIndex(self._max_n)
            index.extend(row.tokens)
            proposals.append(index.propose(row.k) if row.k > 0 else [])
        return proposals

    def grade(self, uid: str) -> int:
        """The grade of `uid`'s latest proposal: the length of the match it continues
        (worker/engines/speculation/graded.py)."""
        index = self._rows.get(uid)
        return index.matched if index is not None else 0

    def accepted(self, uid: str, proposed: int, accepted: int) -> None:
        pass  # the lookup has nothing to learn: the row's tokens say it all

    def forget(self, uid: str) -> None:
        self._rows.pop(uid, None)

    def reset(self) -> None:
        self._rows.clear()
