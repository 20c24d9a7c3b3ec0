"""What a drafter is: something that guesses, for each decoding row, the next few tokens the
served model will make, so that one forward pass of the served model can check several of them at
once (worker/engines/speculation/verify.py). A guess is only ever a proposal: the served model
decides every token, so a bad drafter costs time, never correctness."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence


@dataclass(frozen=True)
class DraftRow:
    """One decoding row asking for a proposal: its `uid`, every token it holds (the prompt, then
    the tokens generated so far; the last one is the row's next input) and at most `k` tokens to
    propose."""

    uid: str
    tokens: Sequence[int]
    k: int


class Drafter(Protocol):
    """Proposes up to k tokens per row; told after each verification how many were accepted."""

    # "ngram" | "draft": the name results report (GenerationResult.speculation.drafter).
    name: str
    # Whether how often its proposals are accepted is the drafter's own (a draft model against the
    # served one) rather than each request's (prompt lookup hits on text that repeats its prompt):
    # then rows that start while it keeps missing start off (speculator.py).
    judged_as_a_whole: bool
    # Whether it can guess a row's first token: a draft model can (it continues the prompt as the
    # served model does); prompt lookup cannot (what follows the chat template's assistant header is
    # the model's own start, not a repeat of the prompt), so its rows wait for their first token.
    guesses_first_token: bool
    # Whether `grade` says how likely each proposal is to be accepted: then the graded policy decides
    # which rows propose (graded.py), else each row's own acceptance does (adaptive.py).
    graded: bool
    # Bytes of its own per decoding row and token (a draft model's keys and values; 0 for none): the
    # engine counts them with the served model's, so that admission keeps both within the KV budget.
    kv_bytes_per_token: int

    def propose(self, rows: Sequence[DraftRow]) -> list[list[int]]:
        """A proposal per row, in order: up to `row.k` tokens that would follow `row.tokens`
        (an empty list: nothing to propose). Deterministic: the same tokens give the same proposal,
        so verification may treat it as a point mass (verify.py)."""
        ...

    def grade(self, uid: str) -> int:
        """The grade of `uid`'s latest proposal, where `graded` (0 otherwise): proposals of one grade
        are alike in how often they are accepted."""
        ...

    def accepted(self, uid: str, proposed: int, accepted: int) -> None:
        """How many of the `proposed` tokens of `uid`'s last proposal the served model accepted."""
        ...

    def forget(self, uid: str) -> None:
        """`uid` ended: drop what is kept for it."""
        ...

    def reset(self) -> None:
        """Drop every row's state (after a failed step or a weight swap)."""
        ...

    def share_kv_budget(self, budget_bytes: int) -> None:
        """Its share of the KV budget (0: none): where bucketed buffers would pass it, they are sized
        exactly, as the engine's are. Called once, before the first proposal."""
        ...
