"""What a verification pass costs next to a decode step, measured while serving.

A pass runs every slot at its width and, since it reads the step before it back, gives up the
overlap of the host's work with the device's: the step in flight is waited for, and the step after
the pass starts the overlap again with a call that reads nothing back. What that costs depends on
the device, the model, the slot count and the width (docs/speculative.md, "Whether a pass pays").
So the engine reports every call it makes (`call`), and time is counted from one call's start to
the next's, the caller's own work between calls included. Every call launches one thing, a decode
step or a pass:

- a plain decode step (one launched, one read back, nothing admitted) takes its interval;
- a pass takes the intervals from its call's start to the start of the first call after it that is
  not a restart, less one step's for each restart (a restart launches a decode step of its own). On
  a GPU a restart is short and most of a pass's call is the overlap it gave up; on a CPU, whose
  launch computes the step, a restart takes about a step;
- a declined look (the step in flight read back early for a pass, then no pass worth running: a
  decode step launched after the read-back) takes its interval less one step's: what reading back
  early cost, `early_read_cost`.

The cost of a pass of `width` at `slots` is the median of its recent passes over the median of the
recent steps at `slots` (a pass that traced a new shape is left out, and so is one whose window
an admission cut short). Until both are measured it is the prior: the platform's default, or the
setting, which when given is used as it is and never measured. A width not yet measured below one
that is costs no more than its share of that one's extra cost, (w - 1) / (m - 1) of it: a narrower
pass does less, and a narrow width left at a prior too dear would never be run, and so never be
measured. A width measured as too dear to run would never be measured again either, so its passes
are forgotten `FORGET_AFTER` decode steps after the latest: then it is tried afresh.

A draft model's calls are timed apart (`drafted`): the seconds the policy spent proposing for a
pass are taken off the call they ran in, and a pass of `width` costs its verification plus width - 1
of the draft's positions, each the median of the recent proposals' time per position over a step's
(at a slot count not yet measured, the nearest measured one's). So a draft that costs as much as the
served model (the model as its own draft, or any draft on a device where every call costs its
launches) is priced as such before a width is run. Its timings are not forgotten: what a draft's
position costs next to a step is the two models' and the device's, and measuring it again would cost
each row the draft's catch-up on its prompt. A call that ran a probe's draft calls is timed as nothing.
"""

from __future__ import annotations

import enum
import logging
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger("mlxq.engine")

SAMPLES = 9  # recent timings kept per shape: a median over them shrugs off a pause
MIN_STEPS = 3
MIN_PASSES = 3
FORGET_AFTER = 256  # decode steps


class Call(enum.Enum):
    """What one engine call did, for the timing of passes against steps."""

    STEP = "step"  # a decode step launched and one read back (with overlap, the one before), nothing admitted
    RESTART = "restart"  # a decode step launched, nothing read back or admitted: the overlap starts again
    PASS = "pass"  # a verification pass of a shape traced before, nothing admitted
    DECLINED = "declined"  # the step in flight read back for a pass the fresh proposals did not pay for
    OTHER = "other"  # anything else: an admission, a pass that traced its shape, an idle call


@dataclass
class _Window:
    slots: int
    width: int
    started: float
    drafting: float  # seconds of the pass's call spent in the drafter
    restarts: int = 0  # decode steps launched after the pass, each in a call that read nothing back


class PassCosts:
    """One engine's timings of its calls, and from them what a pass of each shape costs (above)."""

    def __init__(self, prior: float, measure: bool = True) -> None:
        self.prior = prior
        self.measure = measure
        # Recent timings and their medians, kept as each timing comes: a policy asks for costs several
        # times a step, and on a GPU the host's time per step is the batch's.
        self._steps: dict[int, deque[float]] = {}
        self._step_median: dict[int, float] = {}  # slots -> seconds, once MIN_STEPS were timed
        self._passes: dict[tuple[int, int], deque[float]] = {}
        self._pass_median: dict[tuple[int, int], float] = {}  # (slots, width) -> seconds, once MIN_PASSES ran
        self._latest: dict[tuple[int, int], int] = {}  # the step count at each shape's latest pass
        self._clock = 0  # decode steps timed
        self._reported: set[tuple[int, int]] = set()
        self._window: Optional[_Window] = None  # a pass whose time is still being counted
        self._declined: dict[int, deque[float]] = {}  # what each declined look cost beyond a step, seconds
        self._last: Optional[tuple[Call, int, float, float]] = None  # the latest call: kind, slots, start, drafting
        self._drafting = 0.0  # seconds the call being made has spent in the drafter so far
        self._probing = False  # whether the call being made ran a probe's draft calls
        self._drafts: dict[int, deque[float]] = {}  # slots -> a draft's seconds per proposed position
        self._draft_median: dict[int, float] = {}  # slots -> seconds per proposed position, once MIN_PASSES were timed

    def call(self, started: float, kind: Call, slots: int, width: int = 0) -> None:
        """The engine made a call of `kind` that began at `started` (time.perf_counter()) with `slots`
        slots; a pass gives its width."""
        if not self.measure:
            return
        drafting, self._drafting = self._drafting, 0.0
        if self._probing:
            kind, self._probing = Call.OTHER, False
        last, self._last = self._last, (kind, slots, started, drafting)
        if last is not None:
            last_kind, last_slots, last_started, last_drafting = last
            took = started - last_started - last_drafting
            if last_kind is Call.STEP:
                self.step_took(last_slots, took)
            elif last_kind is Call.DECLINED and (step := self._step_median.get(last_slots)) is not None:
                self._declined.setdefault(last_slots, deque(maxlen=SAMPLES)).append(took - step)
        window, self._window = self._window, None
        if window is not None and kind is Call.RESTART:
            window.restarts += 1
            self._window = window
        elif window is not None and kind is not Call.OTHER:  # an admission would hide the restart's launch
            step = self._step_median.get(window.slots)
            if step is not None:
                self.pass_took(window.slots, window.width,
                               started - window.started - window.drafting - window.restarts * step)
        if kind is Call.PASS:
            self._window = _Window(slots, width, started, drafting)

    def drafted(self, slots: int, positions: int, seconds: float) -> None:
        """A draft model proposed up to `positions` tokens a row at `slots` slots, in `seconds`, during
        the call the engine is making (reported before that call's `call`)."""
        if self.measure and positions > 0:
            self._drafting += seconds
            drafts = self._drafts.setdefault(slots, deque(maxlen=SAMPLES))
            drafts.append(seconds / positions)
            if len(drafts) >= MIN_PASSES:
                self._draft_median[slots] = statistics.median(drafts)

    def probed(self) -> None:
        """A probe's draft calls ran in the call the engine is making: that call is timed as nothing
        (on a GPU the probe also waited for the step in flight, so its time is not the draft's)."""
        self._probing = True

    def step_known(self, slots: int) -> bool:
        """Whether a decode step at `slots` slots has been timed, so that passes there can be (or
        costs are a setting, never measured)."""
        return not self.measure or slots in self._step_median

    def draft_cost(self, slots: int) -> float:
        """A proposed position's draft calls at `slots` slots, in decode steps: where not measured there,
        as at the nearest slot count where it was (a batched draft call grows with the slots as a step
        does, and a row's first proposal runs the draft over its whole prompt: pricing a dear draft
        anew at each slot count would cost that each time); 0 until measured anywhere."""
        measured = self._draft_costs()
        if not measured:
            return 0.0
        return measured[min(measured, key=lambda count: (abs(count - slots), count))]

    def _draft_costs(self) -> dict[int, float]:
        """Slot count -> a proposed position's draft calls there, in decode steps, where measured."""
        return {count: seconds / self._step_median[count] for count, seconds in self._draft_median.items()
                if count in self._step_median}

    def step_took(self, slots: int, seconds: float) -> None:
        if self.measure:
            self._clock += 1
            steps = self._steps.setdefault(slots, deque(maxlen=SAMPLES))
            steps.append(seconds)
            if len(steps) >= MIN_STEPS:
                self._step_median[slots] = statistics.median(steps)
            self._forget_stale()

    def pass_took(self, slots: int, width: int, seconds: float) -> None:
        if self.measure:
            passes = self._passes.setdefault((slots, width), deque(maxlen=SAMPLES))
            passes.append(seconds)
            if len(passes) >= MIN_PASSES:
                self._pass_median[(slots, width)] = statistics.median(passes)
            self._latest[(slots, width)] = self._clock

    def _forget_stale(self) -> None:
        """Passes of a shape none has run for FORGET_AFTER steps: its cost is tried afresh."""
        for shape in [shape for shape, latest in self._latest.items() if self._clock - latest > FORGET_AFTER]:
            del self._passes[shape], self._latest[shape]
            self._pass_median.pop(shape, None)

    def cost(self, slots: int, width: int) -> float:
        """A pass of `width` positions a slot at `slots` slots, its draft calls included, in decode
        steps at `slots` (at least 1)."""
        return self._verification_cost(slots, width) + (width - 1) * self.draft_cost(slots)

    def _verification_cost(self, slots: int, width: int) -> float:
        step = self._step_median.get(slots)
        if step is None:
            return self.prior
        # The width itself if measured, else the nearest measured wider one.
        wider = [w for s, w in self._pass_median if s == slots and w >= width]
        if not wider:
            return self.prior
        measured = min(wider)
        cost = max(1.0, self._pass_median[(slots, measured)] / step)
        if measured > width:
            return min(self.prior, 1 + (cost - 1) * (width - 1) / (measured - 1))
        if (slots, width) not in self._reported:
            self._reported.add((slots, width))
            log.debug("speculation: a pass of width %d at %d slots costs %.2f decode steps (measured)", width, slots, cost)
        return cost

    def early_read_cost(self, slots: int) -> Optional[float]:
        """What reading the step in flight back early for a pass that then did not run costs at
        `slots` slots, in decode steps (at least 0); None until measured."""
        step, looks = self._step_median.get(slots), self._declined.get(slots, ())
        if step is None or len(looks) < MIN_PASSES:
            return None
        return max(0.0, statistics.median(looks) / step)

    def learnt(self) -> dict[str, float]:
        """What has been measured so far, in decode steps: "pass <slots>x<width>" for each shape with
        enough passes (its verification), "draft position <slots>" for each slot count with enough
        timed proposals, and "early read <slots>" for each slot count with enough declined looks."""
        found: dict[str, float] = {}
        for (slots, width), seconds in sorted(self._pass_median.items()):
            step = self._step_median.get(slots)
            if step is not None:
                found[f"pass {slots}x{width}"] = round(seconds / step, 3)
        for slots, draft in sorted(self._draft_costs().items()):
            found[f"draft position {slots}"] = round(draft, 3)
        for slots in sorted(self._declined):
            early = self.early_read_cost(slots)
            if early is not None:
                found[f"early read {slots}"] = round(early, 3)
        return found
