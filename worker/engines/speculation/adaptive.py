"""The adaptive speculation policy: how many tokens a row proposes, and whether it speculates at
all, from the row's own acceptance. It is the draft model's (a row that is off costs no draft call;
prompt lookup's guesses cost nothing and are graded instead, graded.py).

A verification step costs more than a decode step (k more positions through the model, and no
overlap of the host's work with the device's), so a row whose proposals are rejected should stop
proposing. Each row keeps its own k and an average of its acceptance:

- k starts at `START_K` and grows by one after a proposal accepted whole (up to the worker's
  maximum); after a partial acceptance it becomes the accepted count plus one, but not below
  `START_K`: a proposal of one token can add at most one, which does not pay for a pass that costs
  a step or more (speculator.py).
- A row is new (fresh) when it starts and when it comes back on: for its first `MISSES_OFF`
  proposals it is expected to have all its k tokens accepted (k of `START_K` or more), so that its
  batch tries it; a row whose batch finds no pass worth running is new again after `backoff`
  steps. A row that starts while its draft model's recent proposals, over all rows, mostly missed
  starts off instead, for as long as the row that last turned off: an unrelated draft model then
  costs a request a probe at most.
- A row turns speculation off after `MISSES_OFF` proposals in a row with nothing accepted (a step
  where it found nothing to propose counts as one) or once its average acceptance falls under
  `LOW_ACCEPTANCE`; it stays off for `backoff` of its decode steps, then probes (`probing`): one
  proposal, checked against the tokens the row then makes anyway, with no verification pass
  (a `Guess`, speculator.py); a miss turns it off again. The backoff starts at `FIRST_BACKOFF` steps and
  doubles each time a probe fails, up to `MAX_BACKOFF`; a proposal accepted whole resets it.

A probe costs the draft's calls, so rows probe only where a pass could pay at the measured costs
were every proposal accepted whole: a draft whose calls cost what the served model's do (the model
as its own draft) never could, however well it is accepted (its cost per proposed position is
measured apart, pass_cost.py).

So open-ended text, where proposals rarely match, pays the verification passes of its first
`MISSES_OFF` proposals and nothing more but the drafter's guesses; text that repeats its prompt
keeps k at the maximum.

A row that is off still proposes in a pass that runs for other rows: every slot of the pass runs
its full width anyway, so its proposal costs nothing. Such a ride never extends its
backoff; a ride of at least `START_K` tokens accepted whole turns the row back on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from worker.engines.speculation.drafter import DraftRow
from worker.engines.speculation.speculator import Guess, Row, RowPlan, Speculator, StepPlan

START_K = 2
MISSES_OFF = 2
LOW_ACCEPTANCE = 0.2  # the average share of a proposal that was accepted
SMOOTHING = 0.3  # weight of the latest proposal in that average
FIRST_BACKOFF = 16
MAX_BACKOFF = 512


@dataclass
class RowAdaptivity:
    max_k: int
    k: int = START_K
    acceptance: float = 0.5  # running average of accepted / proposed
    misses: int = 0  # proposals in a row with nothing accepted
    off_for: int = 0  # decode steps left with speculation off
    backoff: int = FIRST_BACKOFF
    tries: int = 0  # proposals since it started or came back on
    idle: int = 0  # decode steps on, without a proposal (the batch did not find a pass worth it)
    probing: bool = False  # its next proposal is a probe, made once `off_for` runs out

    def __post_init__(self) -> None:
        self.k = max(1, min(self.k, self.max_k))

    def doubt(self, wait: int = 0) -> None:
        """Probe: one proposal, checked without a pass, and a miss turns it off; first off for `wait`
        steps (then the next wait is twice as long), as a new row is whose drafter lately missed for
        other rows too."""
        self.misses = self.tries = MISSES_OFF - 1
        self.probing = True
        if wait:
            self.off_for, self.backoff = wait, min(MAX_BACKOFF, 2 * wait)

    @property
    def on(self) -> bool:
        """Whether it proposes for verification passes (an off row only rides along in them)."""
        return self.off_for == 0 and not self.probing

    @property
    def probe_due(self) -> bool:
        """Whether its wait is over and its probe is to be made."""
        return self.probing and self.off_for == 0

    def decoded(self) -> None:
        """A decode step began: an off row is one step nearer its probe; a row left waiting while on
        (its batch found no pass worth running) is given the benefit of the doubt again after `backoff`
        steps, as its text may have turned repetitive since."""
        if self.off_for:
            self.off_for -= 1
        elif not self.fresh:
            self.idle += 1
            if self.idle >= self.backoff:
                self.tries, self.idle = 0, 0

    @property
    def fresh(self) -> bool:
        """Too few proposals since it started or came back on for its acceptance to say much (the
        first token of an answer, say, is rarely in the prompt, what follows often is)."""
        return self.tries < MISSES_OFF

    def expected(self, k: int) -> float:
        """Tokens a proposal of `k` is expected to add: a fresh row is given the benefit of the doubt
        (all of them), so that a batch tries it and learns, for proposals of `START_K` or more; a
        proposal of one token (a batch so large that its pass is two positions wide) adds at most one,
        and is judged at the row's running acceptance."""
        return float(k) if self.fresh and k >= START_K else self.acceptance * k

    def record(self, proposed: int, accepted: int) -> None:
        """The outcome of one attempt: `proposed` tokens (0: it found nothing to propose), `accepted` of them."""
        self.tries, self.idle, self.probing = self.tries + 1, 0, False
        if proposed:
            self.acceptance += SMOOTHING * (accepted / proposed - self.acceptance)
        self.misses = 0 if accepted else self.misses + 1
        if proposed and accepted == proposed:
            self.k = min(self.max_k, self.k + 1)
            self.backoff = FIRST_BACKOFF
        elif proposed:
            self.k = max(min(START_K, self.max_k), min(self.max_k, accepted + 1))
        if self.misses >= MISSES_OFF or self.acceptance < LOW_ACCEPTANCE:
            self._turn_off()

    def rode(self, proposed: int, accepted: int) -> None:
        """The outcome of a proposal made while off, in a pass that ran for other rows: only a ride
        accepted whole, of at least `START_K` tokens, counts, and turns the row back on, new."""
        if proposed >= START_K and accepted == proposed:
            self.off_for, self.backoff, self.misses, self.tries, self.idle = 0, FIRST_BACKOFF, 0, 0, 0
            self.probing = False
            self.acceptance, self.k = 0.5, min(self.max_k, proposed)

    def _turn_off(self) -> None:
        self.off_for = self.backoff
        self.backoff = min(MAX_BACKOFF, self.backoff * 2)
        # Back on, it probes: one proposal, and one more miss turns it off again.
        self.acceptance, self.k = 0.5, max(1, min(self.max_k, START_K))
        self.doubt()


class AdaptiveSpeculator(Speculator):
    """The policy above, per row (`RowAdaptivity`), and over every row for a drafter judged as a whole."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self._rows: dict[str, RowAdaptivity] = {}
        self._probes: dict[str, Guess] = {}
        # The drafter's recent acceptance over every row's proposals. While it is under LOW_ACCEPTANCE a new
        # row of a drafter judged as a whole (a draft model) starts off, for `_wait` steps (the wait of the
        # row that last turned off); after MAX_BACKOFF steps with no proposal by a row that is on it is
        # reset, so a drafter gets a new chance.
        self.track = 0.5
        self._wait = FIRST_BACKOFF
        self._quiet = 0

    def adaptivity(self, row: Row) -> RowAdaptivity:
        state = self._rows.get(row.spec.uid)
        if state is None:
            state = self._rows[row.spec.uid] = RowAdaptivity(self.max_k)
            if self.drafter.judged_as_a_whole and self.track < LOW_ACCEPTANCE:
                state.doubt(self._wait)
        return state

    def _may(self, row: Row) -> Optional[RowAdaptivity]:
        """Its adaptivity if it may propose now (not refused, and room left), else None."""
        state = self.adaptivity(row)
        return state if self.refused(row) is None and self._room(row) > 0 else None

    def width(self, rows: Sequence[Row], slot_count: int) -> int:
        """A pass of width w is expected to add, for each row that is on, its running acceptance times
        the tokens it would propose (min(k, w - 1)); a fresh row, all of them (RowAdaptivity.expected)."""
        on = [(state, self._room(row)) for row in rows if (state := self._may(row)) is not None and state.on]
        if not on:
            return 1
        return self._best_width(lambda width: sum(state.expected(min(state.k, width - 1, room)) for state, room in on),
                                len(rows), slot_count, self.max_k + 1)

    def step_began(self, rows: Sequence[Row], slot_count: int, backlog: bool = False) -> None:
        """Rows with speculation off count down to their next probe; probes whose tokens are made are
        settled, and rows whose wait is over make theirs."""
        self._quiet += 1
        if self._quiet >= MAX_BACKOFF:
            self.track, self._wait, self._quiet = 0.5, FIRST_BACKOFF, 0
        for row in rows:
            self.adaptivity(row).decoded()
        self._settle_probes(rows)
        if self._width_limit(slot_count) > 1 and self._could_pay(len(rows), slot_count):
            self._start_probes(rows)

    def _start_probes(self, rows: Sequence[Row]) -> None:
        due = [(row, min(state.k, self._room(row))) for row in rows if row.spec.uid not in self._probes
               and (state := self._may(row)) is not None and state.probe_due]
        if not due:
            return
        drafts = self.drafter.propose([DraftRow(row.spec.uid, row.prompt + row.generated, k) for row, k in due])
        self.costs.probed()
        for (row, k), draft in zip(due, drafts):
            draft = [int(t) for t in draft[:k]]
            if draft:
                self._probes[row.spec.uid] = Guess(len(row.generated), draft)
            else:
                self._learn(row, 0, 0)  # nothing to propose: a miss, as for a row that is on

    def _settle_probes(self, rows: Sequence[Row]) -> None:
        for row in rows:
            settled = self._settled(self._probes, row)
            if settled is not None and self.adaptivity(row).probing:  # (a ride may have turned it on meanwhile)
                probe, kept = settled
                self.probed += len(probe.draft)
                self.probes_accepted += kept
                self._learn(row, len(probe.draft), kept)

    def _plan(self, rows: Sequence[Row], slot_count: int) -> Optional[StepPlan]:
        """Every row that may speculate proposes up to the pass's width (`width`): its slot runs the
        whole width anyway, so a row that is off rides along for free. Rows that are on and found
        nothing to propose count it as a miss; None when none of them proposes anything."""
        width = self.width(rows, slot_count)
        if width < 2:
            return None
        on: list[tuple[Row, int]] = []
        riding: list[tuple[Row, int]] = []
        for row in rows:
            state = self._may(row)
            if state is not None:
                (on if state.on else riding).append((row, min(width - 1, self._room(row))))
        asking = on + riding
        drafting = time.perf_counter()
        drafts = self.drafter.propose([DraftRow(row.spec.uid, row.prompt + row.generated, k) for row, k in asking])
        self.costs.drafted(slot_count, width - 1, time.perf_counter() - drafting)
        drafts = [[int(t) for t in draft[:k]] for draft, (_, k) in zip(drafts, asking)]
        longest = max(len(draft) for draft in drafts[: len(on)])
        for (row, _), draft in zip(on, drafts):
            if not draft:
                self._learn(row, 0, 0)
        if not longest:
            return None
        plan = StepPlan(width=1 + longest)
        plan.rows = [RowPlan(row, draft[:longest]) for (row, _), draft in zip(asking, drafts) if draft]
        return plan

    def outcome(self, row: Row, proposed: int, accepted: int) -> None:
        adaptivity = self.adaptivity(row)
        if adaptivity.on:
            self._learn(row, proposed, accepted)
        else:
            adaptivity.rode(proposed, accepted)
            self.drafter.accepted(row.spec.uid, proposed, accepted)
        self.proposed += proposed
        self.accepted += accepted

    def _learn(self, row: Row, proposed: int, accepted: int) -> None:
        """What a proposal of a row that is on, or a probe, says of the row and of the drafter."""
        adaptivity = self.adaptivity(row)
        adaptivity.record(proposed, accepted)
        if proposed:
            self.track += SMOOTHING * (accepted / proposed - self.track)
            self._quiet = 0
        if not adaptivity.on:
            self._wait = adaptivity.off_for
        self.drafter.accepted(row.spec.uid, proposed, accepted)

    def _per_row(self) -> list[dict[str, Any]]:
        return [*super()._per_row(), self._rows, self._probes]
