"""What a verification pass costs next to a decode step, measured while serving.

A pass runs every slot at its width and, since it reads the step before it back, gives up the
overlap of the host's work with the device's. What that costs depends on the device, the model, the
slot count and the width: on a 2-core CPU a pass at 8 slots took about 1.4 decode steps at width 3
and 2.2 at width 5, on the H200 about 1.7 at any width (docs/speculative.md, "Whether a pass
pays"). So the engine reports the time of every plain decode step (one launched and one read back,
nothing admitted in that call) and of every pass (its drafting, the pass and its read-back), and the
cost of a pass of `width` at `slots` is the median of its recent passes over the median of the
recent steps at `slots` (a pass that traced a new shape first is left out). Until both are
measured it is the prior: the platform's default, or the setting, which when given is used as it is
and never measured. A width measured as too dear to run would never be measured again, so its
passes are forgotten `FORGET_AFTER` decode steps after the latest: then it is tried afresh.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque

log = logging.getLogger("mlxq.engine")

SAMPLES = 9  # recent timings kept per shape: a median over them shrugs off a pause
MIN_STEPS = 3
MIN_PASSES = 3
FORGET_AFTER = 256  # decode steps


class PassCosts:
    def __init__(self, prior: float, measure: bool = True) -> None:
        self.prior = prior
        self.measure = measure
        self._steps: dict[int, deque[float]] = {}
        self._passes: dict[tuple[int, int], deque[float]] = {}
        self._latest: dict[tuple[int, int], int] = {}  # the step count at each shape's latest pass
        self._clock = 0  # decode steps timed
        self._reported: set[tuple[int, int]] = set()

    def step_took(self, slots: int, seconds: float) -> None:
        if self.measure:
            self._clock += 1
            self._steps.setdefault(slots, deque(maxlen=SAMPLES)).append(seconds)

    def pass_took(self, slots: int, width: int, seconds: float) -> None:
        if self.measure:
            self._passes.setdefault((slots, width), deque(maxlen=SAMPLES)).append(seconds)
            self._latest[(slots, width)] = self._clock

    def cost(self, slots: int, width: int) -> float:
        """A pass of `width` positions a slot at `slots` slots, in decode steps at `slots` (at least 1)."""
        if (slots, width) in self._passes and self._clock - self._latest[(slots, width)] > FORGET_AFTER:
            del self._passes[(slots, width)]
        steps, passes = self._steps.get(slots, ()), self._passes.get((slots, width), ())
        if len(steps) < MIN_STEPS or len(passes) < MIN_PASSES:
            return self.prior
        cost = max(1.0, statistics.median(passes) / statistics.median(steps))
        if (slots, width) not in self._reported:
            self._reported.add((slots, width))
            log.debug("speculation: a pass of width %d at %d slots costs %.2f decode steps (measured)",
                      width, slots, cost)
        return cost
