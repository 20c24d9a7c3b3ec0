"""The graded speculation policy, for a drafter that grades its proposals: prompt lookup, whose grade
is the length of the match a proposal continues.

How likely a proposal is to be accepted depends more on how it was made than on the row that made
it: a proposal that continues a match of three tokens is accepted far more often than one after a
match of one (docs/speculative.md, "Graded proposals", has the replay that measured it). So this
policy keeps, per grade, and for greedy and sampled rows apart, the chance that a proposed token is
accepted once the ones before it were (`GradeAcceptance`), and sizes each step's pass by what this
step's proposals are expected to add:

- Every row that may speculate guesses at every step: a dictionary lookup. A guess that no pass
  verifies is settled by the tokens the row then makes (a `Guess`, speculator.py), so guesses teach
  their grade, and a grade that stopped paying is still measured. A pass's proposals replace the
  guesses whose tokens have not decided them yet (counted as far as they went instead, they made the
  replay slower).
- A pass runs when the proposals are expected to add what its extra cost takes from the batch's
  decoding rows, `BATCH_MARGIN` times that where more than one row decodes, at the width that makes
  the most tokens per step's cost. The margin is there because a batch waits for its slowest row:
  the tokens a pass adds to the rows that finish first do not shorten that wait.
- Where no request waits for a slot, the batch waits for the row that ends last. Where rows run to
  their `max_tokens` (under `RUN_TO_LENGTH` of recent rows of their kind ended early, `EarlyEndings`), that is the
  row with the most left to make, and a pass is judged by the steps it is expected to take off that
  wait (`_shortening`). Elsewhere the tokens a pass adds to rows more than a pass's reach ahead of
  that row count for the share of rows ending early (so do those rows in the batch's count): a row
  ahead can only be the one the batch waits for if rows end early.
- `wants` decides before the step in flight is read back whether to read it back for a pass: the
  fresh proposals may then not pay after all, and the early read-back was for nothing. Where that
  costs little (under `CHEAP_EARLY_READ` of a step, measured: pass_cost.py), it judges each row by its
  latest guess as if it were current: judged more strictly, 8 grounded rows on the CPU lost much of
  their gain. Where it costs more (on a GPU it gives up the overlap of the host's work with the
  device's), it judges each guess by what is left of it to verify after the step in flight, were
  the step's token the one guessed (docs/performance.md, "Pass costs from call windows").

There is no per-row on and off: a row whose text stops repeating its prompt guesses with low grades,
or not at all, and those do not pay for a pass.
"""

from __future__ import annotations

from typing import Any, Hashable, Optional, Sequence

from worker.engines.speculation.drafter import DraftRow
from worker.engines.speculation.speculator import Guess, Row, RowPlan, Speculator, StepPlan

BATCH_MARGIN = 2.0
# The share of rows ending early that the policy assumes before any row ended: what a token added to
# a row well ahead counts for then. Replayed, docs/speculative.md.
AHEAD_PRIOR = 0.25
# The weight the ending counts keep at each row's end: about the last twenty rows decide.
ENDINGS_DISCOUNT = 0.95
# Under this share of rows ending early, rows are taken to run to their max_tokens.
RUN_TO_LENGTH = 0.2
# Decode steps: an early read-back that costs less than this is worth risking on guesses as they were made.
CHEAP_EARLY_READ = 0.25
# The weight the counts keep at each new outcome: about the last hundred outcomes of a grade decide.
DISCOUNT = 0.99


class GradeAcceptance:
    """Per grade, the chance that a proposed token is accepted once the ones before it were: a
    Beta(1, 1) prior updated with discounted counts of the tokens accepted and of those tried (the
    accepted ones and the first rejected)."""

    def __init__(self) -> None:
        self._kept: dict[Hashable, float] = {}
        self._tried: dict[Hashable, float] = {}

    def chance(self, grade: Hashable) -> float:
        return (self._kept.get(grade, 0.0) + 1) / (self._tried.get(grade, 0.0) + 2)

    def record(self, grade: Hashable, proposed: int, accepted: int) -> None:
        if proposed:
            self._kept[grade] = DISCOUNT * self._kept.get(grade, 0.0) + accepted
            self._tried[grade] = DISCOUNT * self._tried.get(grade, 0.0) + accepted + (accepted < proposed)

    def expected(self, grade: Hashable, length: int, lead: int = 0) -> float:
        """Tokens a proposal of `length` tokens of this grade is expected to add, where `lead` tokens
        before them must be borne out first (without adding any)."""
        sums = self.expected_by_depth(grade, length, lead)
        return sums[-1] if sums else 0.0

    def expected_by_depth(self, grade: Hashable, length: int, lead: int = 0) -> list[float]:
        """`expected` for the proposal's first 1, 2, ... `length` tokens, in one sweep."""
        chance, total, sums = self.chance(grade), 0.0, []
        for j in range(lead + 1, lead + length + 1):
            total += chance ** j
            sums.append(total)
        return sums


def ending_kind(row: Row) -> tuple[int, int]:
    """Rows alike in how they end: the octave of their prompt's length and of their `max_tokens` (a
    document to summarize or edit against a chat turn; a short limit against a long one)."""
    return len(row.prompt).bit_length(), row.spec.max_tokens.bit_length()


class EarlyEndings:
    """The share of recent rows that ended before their `max_tokens` (at a stop token or string, or
    removed), for each kind of row (`ending_kind`) apart: discounted counts from a prior of
    `AHEAD_PRIOR` worth two rows. Where rows run to their length (open chat under a short limit), which
    row the batch waits for is known from what each has left; where they end early, any row may be the
    last. A worker serving both kinds learns each (one share for all sat between them, docs/performance.md)."""

    def __init__(self) -> None:
        self._counts: dict[tuple[int, int], tuple[float, float]] = {}  # kind: (ended early, ended)

    def share(self, kind: tuple[int, int]) -> float:
        early, ended = self._counts.get(kind, (0.0, 0.0))
        return (early + 2 * AHEAD_PRIOR) / (ended + 2)

    def batch_share(self, rows: Sequence[Row]) -> float:
        """The rows' shares, averaged."""
        return sum(self.share(ending_kind(row)) for row in rows) / len(rows) if rows else AHEAD_PRIOR

    def record(self, kind: tuple[int, int], early: bool) -> None:
        early_so_far, ended = self._counts.get(kind, (0.0, 0.0))
        self._counts[kind] = (ENDINGS_DISCOUNT * early_so_far + early, ENDINGS_DISCOUNT * ended + 1)

    def shares(self) -> dict[str, float]:
        """Each kind's share, named by the prompt lengths and `max_tokens` it covers (for reports)."""
        def octave(bits: int) -> str:
            return f"{1 << (bits - 1) if bits else 0}-{(1 << bits) - 1}"
        return {f"prompt {octave(p)} tokens, max_tokens {octave(m)}": self.share((p, m)) for p, m in sorted(self._counts)}


class GradedSpeculator(Speculator):
    """The policy above; its drafter has `grade(uid)`, the grade of that row's latest proposal."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.grades = GradeAcceptance()
        self.endings = EarlyEndings()
        self._guesses: dict[str, Guess] = {}  # each row's guess that no pass verifies
        self._verifying: dict[str, Hashable] = {}  # the grade of each proposal in the running pass
        self._backlog = False  # whether requests wait for a slot this step (step_began)

    def _asking(self, rows: Sequence[Row], slot_count: int) -> list[tuple[Row, int]]:
        """The rows that may propose, and how many tokens each may."""
        widest = self._width_limit(slot_count) - 1
        if widest < 1:
            return []
        return [(row, min(widest, room)) for row in rows if (room := self._room(row)) > 0 and self.refused(row) is None]

    def _margin(self, rows: int) -> float:
        return BATCH_MARGIN if rows > 1 else 1.0

    def _waits_for_last(self, rows: int) -> bool:
        """Whether the batch waits for its last row: no request waits for a slot, and more than one
        row decodes."""
        return not self._backlog and rows > 1

    def _ahead(self, rows: Sequence[Row]) -> dict[str, int]:
        """How many tokens each row is ahead of the row with the most left to make; all 0 while
        requests wait for a slot (a row that ends sooner frees its slot for one) or a row decodes alone."""
        if not self._waits_for_last(len(rows)):
            return {row.spec.uid: 0 for row in rows}
        left = {row.spec.uid: row.spec.max_tokens - len(row.generated) for row in rows}
        most = max(left.values())
        return {uid: most - tokens for uid, tokens in left.items()}

    def _width_for(self, rows: Sequence[Row], drafts: dict[str, tuple[int, Hashable]], slot_count: int,
                   lead: int = 0) -> int:
        """The width that the rows' drafts ({uid: (length, grade)}) are worth, where the first `lead`
        tokens of each draft must be borne out first."""
        ahead, waits_for_last = self._ahead(rows), self._waits_for_last(len(rows))
        share = self.endings.batch_share(rows) if waits_for_last else 1.0  # (else every row is 0 ahead)
        if waits_for_last and share < RUN_TO_LENGTH:
            steps = self._shortening(ahead, drafts, lead)
            return self._best_width(lambda width: steps[width - 2], len(ahead), slot_count, 1 + len(steps))
        weights = {uid: 1.0 if by <= self.max_k else share for uid, by in ahead.items()}
        gains = self._gains([(weights[uid], length, grade) for uid, (length, grade) in drafts.items()], lead)
        return self._best_width(lambda width: gains[width - 2], sum(weights.values()), slot_count, 1 + len(gains),
                                margin=self._margin(len(ahead)))

    def _shortening(self, ahead: dict[str, int], drafts: dict[str, tuple[int, Hashable]], lead: int) -> list[float]:
        """For rows that run to their length: at each width from 2 up, the steps a pass is expected to take
        off the batch's wait, times the batch's rows (tokens, as `_gains`). The wait is the most any row
        has left, so the m-th step comes off only if every row less than m tokens ahead gains at least m
        less how far ahead it is: a row without a draft long enough stops it."""
        longest = max((length - lead for length, _ in drafts.values()), default=0)
        steps, total = [], 0.0
        for m in range(1, longest + 1):
            chance = 1.0
            for uid, by in ahead.items():
                need = m - by
                if need <= 0:
                    continue
                length, grade = drafts.get(uid, (0, None))
                if length - lead < need:
                    chance = 0.0
                    break
                chance *= self.grades.chance(grade) ** (lead + need)
            total += chance
            steps.append(len(ahead) * total)
        return steps

    def _gains(self, proposals: Sequence[tuple[float, int, Hashable]], lead: int) -> list[float]:
        """The tokens the proposals are expected to add at each width from 2 up to the longest's
        (`GradeAcceptance.expected` of each, weighted and summed), in one sweep a proposal: this runs
        every step."""
        longest = max((length - lead for _, length, _ in proposals), default=0)
        gains = [0.0] * max(0, longest)
        for weight, length, grade in proposals:
            sums = self.grades.expected_by_depth(grade, max(0, length - lead), lead)
            for j in range(len(gains)):
                gains[j] += weight * (sums[min(j, len(sums) - 1)] if sums else 0.0)
        return gains

    def step_began(self, rows: Sequence[Row], slot_count: int, backlog: bool = False) -> None:
        """Guesses whose tokens are made are settled; every row without one guesses anew."""
        self._backlog = backlog
        for row in rows:
            settled = self._settled(self._guesses, row)
            if settled is not None:
                guess, kept = settled
                self.grades.record(guess.grade, len(guess.draft), kept)
                self.probed += len(guess.draft)
                self.probes_accepted += kept
        if self._could_pay(len(rows), slot_count):
            self._guess([(row, k) for row, k in self._asking(rows, slot_count) if row.spec.uid not in self._guesses])

    def _guess(self, asking: Sequence[tuple[Row, int]]) -> list[Guess]:
        """Each asking row's proposal, graded by the drafter, for greedy and sampled rows apart; those
        not empty become the rows' guesses."""
        drafts = self.drafter.propose([DraftRow(row.spec.uid, row.prompt + row.generated, k) for row, k in asking])
        made = []
        for (row, k), draft in zip(asking, drafts):
            grade = (self.drafter.grade(row.spec.uid), row.spec.sampling.temperature == 0)
            made.append(Guess(len(row.generated), [int(t) for t in draft[:k]], grade))
            if made[-1].draft:
                self._guesses[row.spec.uid] = made[-1]
        return made

    def _latest(self, rows: Sequence[Row]) -> list[tuple[Row, Guess]]:
        """Each row that has a guess no pass verified, with it."""
        return [(row, guess) for row in rows if (guess := self._guesses.get(row.spec.uid)) is not None]

    def width(self, rows: Sequence[Row], slot_count: int) -> int:
        """What the rows' latest guesses are worth, as they were made."""
        drafts = {row.spec.uid: (len(guess.draft), guess.grade) for row, guess in self._latest(rows)}
        return self._width_for(rows, drafts, slot_count)

    def wants(self, rows: Sequence[Row], slot_count: int, in_flight: bool = False) -> bool:
        """Whether the rows' latest guesses are worth reading the step `in_flight` back early for a pass:
        as they were made where that read costs little, else by what is left of each to verify after
        that step (module docstring)."""
        early_read = self.costs.early_read_cost(slot_count) if in_flight else None
        if early_read is None or early_read < CHEAP_EARLY_READ:
            return self.width(rows, slot_count) > 1
        left = {row.spec.uid: (guess.left(row.generated), guess.grade) for row, guess in self._latest(rows)}
        return self._width_for(rows, left, slot_count, lead=1) > 1

    def _plan(self, rows: Sequence[Row], slot_count: int) -> Optional[StepPlan]:
        """Every row that may propose guesses from its tokens now; the pass runs at the width those
        guesses are worth, or not at all (then the rows' tokens settle them)."""
        asking = self._asking(rows, slot_count)
        for row, _ in asking:
            self._guesses.pop(row.spec.uid, None)
        made = self._guess(asking)
        drafts = {row.spec.uid: (len(guess.draft), guess.grade) for (row, _), guess in zip(asking, made) if guess.draft}
        width = self._width_for(rows, drafts, slot_count)
        if width < 2:
            return None
        plan = StepPlan(width=width)
        for (row, _), guess in zip(asking, made):
            if guess.draft:
                del self._guesses[row.spec.uid]
                self._verifying[row.spec.uid] = guess.grade
                plan.rows.append(RowPlan(row, guess.draft[: width - 1]))
        return plan

    def outcome(self, row: Row, proposed: int, accepted: int) -> None:
        grade = self._verifying.pop(row.spec.uid, None)
        if grade is not None:
            self.grades.record(grade, proposed, accepted)
        super().outcome(row, proposed, accepted)

    def ended(self, row: Row) -> None:
        self.endings.record(ending_kind(row), early=len(row.generated) < row.spec.max_tokens)
        super().ended(row)

    def _per_row(self) -> list[dict[str, Any]]:
        return [*super()._per_row(), self._guesses, self._verifying]

    def reset(self) -> None:
        """What was learnt of the grades held for the old weights too."""
        super().reset()
        self.grades = GradeAcceptance()
