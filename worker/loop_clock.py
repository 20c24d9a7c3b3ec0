"""Where the batch loop's time goes, per section, summed since the worker started.

`lap(section)` charges the time since the previous lap to `section`; the loop laps after each of
its parts, so the sections add up to the loop's whole wall time. Published with the engine's own
counters in the worker's stats hash (`loop_<section>_s`).
"""

from __future__ import annotations

import time
from typing import Any


class LoopClock:
    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, section: str) -> None:
        now = time.perf_counter()
        self._seconds[section] = self._seconds.get(section, 0.0) + now - self._last
        self._last = now

    def as_dict(self) -> dict[str, Any]:
        return {f"{section}_s": seconds for section, seconds in self._seconds.items()}
