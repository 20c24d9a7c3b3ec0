"""Which rows speculate in a step, and how far: the compiled engine's speculation policy.

Per row: whether it may speculate at all (`refusal`: the request opted out, or a feature whose
processing depends on the tokens before each position), its adaptivity (adaptive.py) and its
drafter's state. Per step: the rows that propose and their proposals, and the width of the
verification pass, capped so that slots x width stays within `max_positions` (a large batch is
already compute-bound: extra positions there cost about what they could save).

A row that is off probes without a pass: its drafter proposes from the tokens the row has, and the
tokens the row then makes decide the probe. Verification would accept the same tokens: a position's
proposal is kept when the token drawn there equals it, and the decode step draws that very token
(verify.py). So a probe costs the drafter's guess alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence

from worker.engines.base import SequenceSpec
from worker.engines.speculation.adaptive import FIRST_BACKOFF, LOW_ACCEPTANCE, MAX_BACKOFF, SMOOTHING, RowAdaptivity
from worker.engines.speculation.drafter import Drafter, DraftRow
from worker.engines.speculation.pass_cost import PassCosts

log = logging.getLogger("mlxq.engine")

DEFAULT_MAX_K = 4
# Slots x width of a verification pass at most: 8 slots verify up to 8 positions each, 16 up to 4,
# 32 up to 2, 64 and more do not speculate.
DEFAULT_MAX_POSITIONS = 64
# A verification pass runs only when the rows that would propose are expected (their running
# acceptance times their k) to add at least (pass cost - 1) tokens per decoding row, and never less
# than this: the pass costs the whole batch its wider step and, on a GPU, the overlap, so one probing
# row does not hold up thirty others.
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
class _RowState:
    refusal: Optional[str]
    adaptivity: RowAdaptivity


@dataclass
class _Probe:
    """A probe in progress: `draft` guesses the row's tokens from its `start`-th generated token on."""

    start: int
    draft: list[int]


class Speculator:
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
        self._rows: dict[str, _RowState] = {}
        self._probes: dict[str, _Probe] = {}
        self._logged: set[str] = set()
        # The drafter's recent acceptance over every row's proposals. While it is under LOW_ACCEPTANCE a new
        # row of a drafter judged as a whole (a draft model) starts off, for `_wait` steps (the wait of the
        # row that last turned off); after MAX_BACKOFF steps with no proposal by a row that is on it is
        # reset, so a drafter gets a new chance.
        self.track = 0.5
        self._wait = FIRST_BACKOFF
        self._quiet = 0
        self.proposed = 0  # totals since start, for the engine's stats
        self.accepted = 0
        self.steps = 0
        self.probed = 0  # tokens proposed in probes, and those the row then made
        self.probes_accepted = 0

    @property
    def pass_cost(self) -> float:
        """The pass cost it was given: the prior of every width's measured cost (pass_cost.py)."""
        return self.costs.prior

    @property
    def name(self) -> str:
        return self.drafter.name

    def _state(self, row: Row) -> _RowState:
        state = self._rows.get(row.spec.uid)
        if state is None:
            reason = refusal(row)
            if reason is not None and row.spec.speculative and reason not in self._logged:
                self._logged.add(reason)
                log.info("speculation: rows with %s do not speculate (logged once)", reason)
            adaptivity = RowAdaptivity(self.max_k)
            if self.drafter.judged_as_a_whole and self.track < LOW_ACCEPTANCE:
                adaptivity.doubt(self._wait)
            state = self._rows[row.spec.uid] = _RowState(reason, adaptivity)
        return state

    def _width_limit(self, slot_count: int) -> int:
        return min(self.max_k + 1, self.max_positions // max(1, slot_count))

    def _room(self, row: Row) -> int:
        """Tokens it may still propose: the step makes one token of its own, and none past max_tokens;
        none before its first token where the drafter cannot guess that one (drafter.py)."""
        if not row.generated and not self.drafter.guesses_first_token:
            return 0
        return row.spec.max_tokens - len(row.generated) - 1

    def width(self, rows: Sequence[Row], slot_count: int) -> int:
        """The width of the verification pass worth running this step (1: none is). A pass of width w
        and cost c makes n + E(w) tokens where a decode step makes n (n rows decoding, E(w) what the
        rows that are on are expected to add proposing up to w - 1 tokens each, capped by their k);
        it is worth it when E(w) >= n (c - 1), and the width chosen makes the most tokens per step's
        cost."""
        limit = self._width_limit(slot_count) - 1
        on = [(state.adaptivity, room) for state, room in ((self._state(row), self._room(row)) for row in rows)
              if state.refusal is None and state.adaptivity.on and room > 0]
        best, best_rate = 1, 0.0
        for width in range(2, limit + 2) if on else ():
            expected = sum(adaptivity.expected(min(adaptivity.k, width - 1, room)) for adaptivity, room in on)
            cost = self.costs.cost(slot_count, width)
            if expected > 0 and expected >= max(MIN_EXPECTED_GAIN, cost - 1) * len(rows):
                rate = (len(rows) + expected) / cost
                if rate > best_rate:
                    best, best_rate = width, rate
        return best

    def wants(self, rows: Sequence[Row], slot_count: int) -> bool:
        """Whether some row would propose this step (then the engine reads the step in flight back
        first: a proposal continues each row's latest token)."""
        return self.width(rows, slot_count) > 1

    def step_began(self, rows: Sequence[Row], slot_count: int) -> None:
        """Every engine step (each row's tokens are those read back so far): rows with speculation
        off count down to their next probe; probes whose tokens are made are settled, and rows whose
        wait is over make theirs."""
        self._quiet += 1
        if self._quiet >= MAX_BACKOFF:
            self.track, self._wait, self._quiet = 0.5, FIRST_BACKOFF, 0
        for row in rows:
            self._state(row).adaptivity.decoded()
        self._settle_probes(rows)
        if self._width_limit(slot_count) > 1:
            self._start_probes(rows)

    def _start_probes(self, rows: Sequence[Row]) -> None:
        due = [(row, min(state.adaptivity.k, room)) for row in rows if row.spec.uid not in self._probes
               and (state := self._state(row)).refusal is None and state.adaptivity.probe_due
               and (room := self._room(row)) > 0]
        if not due:
            return
        drafts = self.drafter.propose([DraftRow(row.spec.uid, row.prompt + row.generated, k) for row, k in due])
        for (row, k), draft in zip(due, drafts):
            draft = [int(t) for t in draft[:k]]
            if draft:
                self._probes[row.spec.uid] = _Probe(len(row.generated), draft)
            else:
                self._learn(row, 0, 0)  # nothing to propose: a miss, as for a row that is on

    def _settle_probes(self, rows: Sequence[Row]) -> None:
        for row in rows:
            probe = self._probes.get(row.spec.uid)
            if probe is None:
                continue
            made = row.generated[probe.start:probe.start + len(probe.draft)]
            kept = next((i for i, (a, b) in enumerate(zip(made, probe.draft)) if a != b), len(made))
            if kept == len(probe.draft) or kept < len(made):
                del self._probes[row.spec.uid]
                if self._state(row).adaptivity.probing:  # (a ride may have turned it on meanwhile)
                    self.probed += len(probe.draft)
                    self.probes_accepted += kept
                    self._learn(row, len(probe.draft), kept)

    def plan(self, rows: Sequence[Row], slot_count: int) -> Optional[StepPlan]:
        """The proposals of this step's rows (each row's tokens are up to date), or None when no pass
        is worth running or no row that is on proposes anything. Every row that may speculate
        proposes up to the pass's width (`width`): its slot runs the whole width anyway, so a row
        that is off rides along for free. Rows that are on and found nothing to propose count it
        as a miss."""
        width = self.width(rows, slot_count)
        if width < 2:
            return None
        on: list[tuple[Row, _RowState, int]] = []
        riding: list[tuple[Row, _RowState, int]] = []
        for row in rows:
            state = self._state(row)
            room = self._room(row)
            if state.refusal is None and room > 0:
                (on if state.adaptivity.on else riding).append((row, state, room))
        asking = [(row, state, min(width - 1, room)) for row, state, room in on + riding]
        drafts = self.drafter.propose([DraftRow(row.spec.uid, row.prompt + row.generated, k) for row, _, k in asking])
        drafts = [[int(t) for t in draft[:k]] for draft, (_, _, k) in zip(drafts, asking)]
        longest = max(len(draft) for draft in drafts[: len(on)])
        for (row, _, _), draft in zip(on, drafts):
            if not draft:
                self._learn(row, 0, 0)
        if not longest:
            return None
        plan = StepPlan(width=1 + longest)
        plan.rows = [RowPlan(row, draft[:longest]) for (row, _, _), draft in zip(asking, drafts) if draft]
        return plan

    def outcome(self, row: Row, proposed: int, accepted: int) -> None:
        """`accepted` of the `proposed` tokens of `row`'s proposal were accepted by a verification pass."""
        adaptivity = self._state(row).adaptivity
        if adaptivity.on:
            self._learn(row, proposed, accepted)
        else:
            adaptivity.rode(proposed, accepted)
            self.drafter.accepted(row.spec.uid, proposed, accepted)
        self.proposed += proposed
        self.accepted += accepted

    def _learn(self, row: Row, proposed: int, accepted: int) -> None:
        """What a proposal of a row that is on, or a probe, says of the row and of the drafter."""
        adaptivity = self._state(row).adaptivity
        adaptivity.record(proposed, accepted)
        if proposed:
            self.track += SMOOTHING * (accepted / proposed - self.track)
            self._quiet = 0
        if not adaptivity.on:
            self._wait = adaptivity.off_for
        self.drafter.accepted(row.spec.uid, proposed, accepted)

    def forget(self, uid: str) -> None:
        self._rows.pop(uid, None)
        self._probes.pop(uid, None)
        self.drafter.forget(uid)

    def reset(self) -> None:
        """Every row starts over (after a failed step, or a weight swap: what was learnt of the old
        weights' acceptance, and a draft model's caches, no longer hold)."""
        self._rows.clear()
        self._probes.clear()
        self.drafter.reset()

    @property
    def tracked_rows(self) -> int:
        """Rows whose state it keeps (those decoding)."""
        return len(self._rows)

    def stats(self) -> dict[str, int]:
        return {"speculative_steps": self.steps, "speculative_proposed": self.proposed,
                "speculative_accepted": self.accepted, "speculative_probed": self.probed,
                "speculative_probes_accepted": self.probes_accepted}
