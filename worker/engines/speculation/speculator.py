"""Which rows speculate in a step, and how far: what the compiled engine asks of a speculation
policy, and what every policy shares.

Per row: whether it may speculate at all (`refusal`: the request opted out, or a feature whose
processing depends on the tokens before each position), and how many tokens it may propose. Per
step: the rows that propose and their proposals, and the width of the verification pass, capped so
that slots x width stays within `max_positions` (a large batch is already compute-bound: extra
positions there cost about what they could save), chosen where the tokens it is expected to add pay
for its cost.

Two policies decide who proposes: adaptive.py (each row's own acceptance turns it on and off: a
draft model, whose calls cost) and graded.py (every row guesses at every step and each guess is
judged by its grade: prompt lookup). `speculator_for` picks the drafter's.

A guess that no pass verifies is checked against the tokens the row then makes: verification would
accept the same tokens, as a position's proposal is kept when the token drawn there equals it, and
the decode step draws that very token (verify.py). So such a guess costs the drafter's call alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional, Protocol, Sequence

from worker.engines.base import SequenceSpec
from worker.engines.speculation.drafter import Drafter
from worker.engines.speculation.pass_cost import PassCosts

log = logging.getLogger("mlxq.engine")

DEFAULT_MAX_K = 4
# Slots x width of a verification pass at most: 8 slots verify up to 8 positions each, 16 up to 4,
# 32 up to 2, 64 and more do not speculate.
DEFAULT_MAX_POSITIONS = 64
# A verification pass runs only when its proposals are expected (each policy says how) to add at least
# (pass cost - 1) tokens per decoding row, and never less than this: the pass costs the whole batch its
# wider step and, on a GPU, the overlap, so one probing row does not hold up thirty others.
MIN_EXPECTED_GAIN = 0.25
# A verification pass's time over a decode step's, by default, per platform (docs/speculative.md,
# "Whether a pass pays"): measured on a CPU and on CUDA (where the pass also gives up the overlap of
# host and device); on Metal a guess, as a step of few rows is bound by reading the weights.
DEFAULT_PASS_COST = {"cpu": 2.0, "cuda": 1.75, "metal": 1.25}


class Row(Protocol):
    """What the policy reads of a decoding sequence (worker/engines/compiled_rows.py)."""

    spec: SequenceSpec
    prompt: list[int]
    generated: list[int]
    constraint: Any


def refusal(row: Row) -> Optional[str]:
    """Why `row` never speculates (None: it may). Logit bias, seeds, every sampling setting, logprobs
    of every mode, stop strings and adapters speculate: verification applies them at every position
    exactly as a decode step does."""
    spec = row.spec
    if not spec.speculative:
        return "the request asked for speculative: false"
    if row.constraint is not None:
        return "structured output: its matcher takes one token at a time"
    p = spec.sampling
    if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
        return "repetition, presence and frequency penalties depend on every token before each position"
    return None


@dataclass
class RowPlan:
    """One row's proposal in a verification step."""

    seq: Any  # the DecodingSequence
    draft: list[int]


@dataclass
class StepPlan:
    width: int  # positions per slot: 1 + the longest proposal
    rows: list[RowPlan] = field(default_factory=list)


@dataclass
class Guess:
    """A proposal that no pass verifies: `draft` guesses a row's tokens from its `start`-th
    generated token on, and the tokens the row makes decide it."""

    start: int
    draft: list[int]
    grade: Hashable = None  # the drafter's grade of it, for the graded policy

    def kept(self, generated: Sequence[int]) -> Optional[int]:
        """How many of its tokens the row made, once that is known (all made, or one differed)."""
        made = generated[self.start:self.start + len(self.draft)]
        kept = next((i for i, (a, b) in enumerate(zip(made, self.draft)) if a != b), len(made))
        return kept if kept == len(self.draft) or kept < len(made) else None

    def left(self, generated: Sequence[int]) -> int:
        """How many of its tokens the row has still to make."""
        return len(self.draft) - min(len(self.draft), max(0, len(generated) - self.start))


class Speculator:
    """A speculation policy's interface to the compiled engine, and what every policy shares: the
    drafter, the pass costs, the rows' refusals and room, the choice of width and the counters."""

    def __init__(self, drafter: Drafter, max_k: int = DEFAULT_MAX_K, max_positions: int = DEFAULT_MAX_POSITIONS,
                 pass_cost: float = DEFAULT_PASS_COST["metal"], measure_cost: bool = False) -> None:
        """`pass_cost`: a verification pass's time over a decode step's (worker/loading.py picks it per
        device); with `measure_cost` only until the engine has measured it (pass_cost.py)."""
        if max_k < 1:
            raise ValueError(f"speculative_k: must be >= 1, got {max_k}")
        self.costs = PassCosts(pass_cost, measure=measure_cost)
        self.drafter = drafter
        self.max_k = max_k
        self.max_positions = max_positions
        self._refusals: dict[str, Optional[str]] = {}
        self._logged: set[str] = set()
        self.proposed = 0  # totals since start, for the engine's stats
        self.accepted = 0
        self.steps = 0
        self.probed = 0  # tokens guessed and left to the tokens the rows made, and those they made
        self.probes_accepted = 0
        self.declined = 0  # plans that found no pass worth running

    @property
    def pass_cost(self) -> float:
        """The pass cost it was given: the prior of every width's measured cost (pass_cost.py)."""
        return self.costs.prior

    @property
    def name(self) -> str:
        return self.drafter.name

    def refused(self, row: Row) -> Optional[str]:
        """`refusal(row)`, kept per row, each reason logged once."""
        uid = row.spec.uid
        if uid not in self._refusals:
            reason = self._refusals[uid] = refusal(row)
            if reason is not None and row.spec.speculative and reason not in self._logged:
                self._logged.add(reason)
                log.info("speculation: rows with %s do not speculate (logged once)", reason)
        return self._refusals[uid]

    def _width_limit(self, slot_count: int) -> int:
        return min(self.max_k + 1, self.max_positions // max(1, slot_count))

    def _room(self, row: Row) -> int:
        """Tokens it may still propose: the step makes one token of its own, and none past max_tokens;
        none before its first token where the drafter cannot guess that one (drafter.py)."""
        if not row.generated and not self.drafter.guesses_first_token:
            return 0
        return row.spec.max_tokens - len(row.generated) - 1

    def _best_width(self, expected: Callable[[int], float], rows: float, slot_count: int, widest: int,
                    margin: float = 1.0) -> int:
        """The width worth running (1: none) when a pass of width w is expected to add `expected(w)`
        tokens to a batch of `rows` decoding rows, up to `widest`: a pass of cost c makes rows + E(w)
        tokens where a decode step makes `rows`, so it pays when E(w) >= rows (c - 1), times `margin`;
        of the widths that pay, the one that makes the most tokens per step's cost."""
        if not self.costs.step_known(slot_count):
            return 1  # a pass is timed against a step at its slot count: a few steps there come first
        best, best_rate = 1, 0.0
        for width in range(2, min(widest, self._width_limit(slot_count)) + 1):
            gain, cost = expected(width), self.costs.cost(slot_count, width)
            if gain > 0 and gain >= max(MIN_EXPECTED_GAIN, margin * (cost - 1)) * rows:
                rate = (rows + gain) / cost
                if rate > best_rate:
                    best, best_rate = width, rate
        return best

    def _margin(self, rows: int) -> float:
        """How many times a pass's extra cost its expected tokens must make up (`_best_width`)."""
        return 1.0

    def _could_pay(self, rows: int, slot_count: int) -> bool:
        """Whether a pass could pay here at the costs known were every row's proposal accepted whole:
        where not (at 32 slots, passes of two positions, where a pass costs 1.5 steps or more; a draft
        whose calls cost what the served model's do), guesses and probes buy nothing."""
        return self._best_width(lambda width: rows * (width - 1), rows, slot_count, self.max_k + 1,
                                margin=self._margin(rows)) > 1

    def wants(self, rows: Sequence[Row], slot_count: int, in_flight: bool = False) -> bool:
        """Whether some row would propose this step (then the engine reads the step `in_flight`, if one
        is, back first: a proposal continues each row's latest token)."""
        return self.width(rows, slot_count) > 1

    def width(self, rows: Sequence[Row], slot_count: int) -> int:
        """The width of the verification pass this step is expected to be worth (1: none), judged
        before the rows' latest tokens are read back."""
        raise NotImplementedError

    def step_began(self, rows: Sequence[Row], slot_count: int, backlog: bool = False) -> None:
        """Every engine step, with each row's tokens as read back so far; `backlog`: whether
        requests wait for a slot (every slot is taken, or prompts wait for admission)."""
        raise NotImplementedError

    def plan(self, rows: Sequence[Row], slot_count: int) -> Optional[StepPlan]:
        """The proposals of this step's rows (each row's tokens are up to date), or None when no pass
        is worth running (a look `declined`)."""
        plan = self._plan(rows, slot_count)
        self.declined += plan is None
        return plan

    def _plan(self, rows: Sequence[Row], slot_count: int) -> Optional[StepPlan]:
        raise NotImplementedError

    def outcome(self, row: Row, proposed: int, accepted: int) -> None:
        """`accepted` of the `proposed` tokens of `row`'s proposal were accepted by a verification pass."""
        self.proposed += proposed
        self.accepted += accepted
        self.drafter.accepted(row.spec.uid, proposed, accepted)

    def _settled(self, guesses: dict[str, Guess], row: Row) -> Optional[tuple[Guess, int]]:
        """`row`'s guess in `guesses` and how many of its tokens the row made, once those decide it
        (the guess is then dropped); None before."""
        guess = guesses.get(row.spec.uid)
        kept = guess.kept(row.generated) if guess is not None else None
        if guess is None or kept is None:
            return None
        del guesses[row.spec.uid]
        return guess, kept

    def _per_row(self) -> list[dict[str, Any]]:
        """Every map it keeps by row uid: `forget`, `reset` and `tracked_rows` go through them."""
        return [self._refusals]

    def ended(self, row: Row) -> None:
        """`row` ended, at its length, a stop or removed: nothing of it is kept."""
        self.forget(row.spec.uid)

    def forget(self, uid: str) -> None:
        for state in self._per_row():
            state.pop(uid, None)
        self.drafter.forget(uid)

    def reset(self) -> None:
        """Every row starts over (after a failed step, or a weight swap: what was learnt of the old
        weights' acceptance, and a draft model's caches, no longer hold)."""
        for state in self._per_row():
            state.clear()
        self.drafter.reset()

    @property
    def tracked_rows(self) -> int:
        """Rows whose state it keeps (those decoding)."""
        return len(set().union(*self._per_row()))

    def stats(self) -> dict[str, int]:
        return {"speculative_steps": self.steps, "speculative_proposed": self.proposed,
                "speculative_accepted": self.accepted, "speculative_probed": self.probed,
                "speculative_probes_accepted": self.probes_accepted, "speculative_declined": self.declined}
