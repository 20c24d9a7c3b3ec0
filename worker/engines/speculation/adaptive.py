"""Per-row adaptivity: how many tokens a row proposes, and whether it speculates at all.

A verification step costs more than a decode step (k more positions through the model, and no
overlap of the host's work with the device's), so a row whose proposals are rejected should stop
proposing. Each row keeps its own k and an average of its acceptance:

- k starts at `START_K` and grows by one after a proposal accepted whole (up to the worker's
  maximum); after a partial acceptance it becomes the accepted count plus one, but not below
  `START_K`: a proposal of one token can add at most one, which does not pay for a pass that costs
  a step or more (speculator.py).
- A row is new (fresh) when it starts and when it comes back on: for its first `MISSES_OFF`
  proposals it is expected to have all its k tokens accepted (k of `START_K` or more), so that its
  batch tries it; a row whose batch finds no pass worth running (speculator.py) is new again after
  `backoff` steps. A row that starts
  while its draft model's recent proposals, over all rows, mostly missed starts off instead, for as
  long as the row that last turned off (speculator.py): an unrelated draft model then costs a
  request a probe at most.
- A row turns speculation off after `MISSES_OFF` proposals in a row with nothing accepted (a step
  where it found nothing to propose counts as one) or once its average acceptance falls under
  `LOW_ACCEPTANCE`; it stays off for `backoff` of its decode steps, then probes (`probing`): one
  proposal, checked against the tokens the row then makes anyway, with no verification pass
  (speculator.py); a miss turns it off again. The backoff starts at `FIRST_BACKOFF` steps and
  doubles each time a probe fails, up to `MAX_BACKOFF`; a proposal accepted whole resets it.

So open-ended text, where proposals rarely match, pays the verification passes of its first
`MISSES_OFF` proposals and nothing more but the drafter's guesses; text that repeats its prompt
keeps k at the maximum.

A row that is off still proposes in a pass that runs for other rows (speculator.py): every slot of
the pass runs its full width anyway, so its proposal costs nothing. Such a ride never extends its
backoff; a ride of at least `START_K` tokens accepted whole turns the row back on.
"""

from __future__ import annotations

from dataclasses import dataclass

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
