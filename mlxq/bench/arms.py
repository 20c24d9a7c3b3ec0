"""What every arm offers the runner: start, run a workload (after a warm-up pass), stop."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

from mlxq.bench.workloads import RequestRecord, Workload

Outcome = Union[list[RequestRecord], BaseException]
Plan = Sequence[tuple[Workload, Optional[Workload]]]  # (workload, its warm-up pass)
OnOutcome = Callable[[Workload, Outcome], None]


class ArmSkipped(Exception):
    """The arm cannot run here; the message says why (it goes into the report)."""


class Arm:
    key = "?"
    label = "?"
    # How this arm's queue time and TTFT are measured: goes into the report verbatim.
    methods: dict[str, str] = {}
    # What the arm's engine did during its last run, where it can tell: prefill and decode
    # seconds, calls and steps (worker/engines/counters.py), and for mlxq the batch loop's sections.
    time_split: Optional[dict[str, float]] = None

    def start(self) -> None:
        """Load models, start processes. May raise ArmSkipped."""

    def stop(self) -> None:
        """Stop everything `start` started; must be safe to call twice."""

    def info(self) -> dict[str, Any]:
        return {}

    def run(self, workload: Workload, warmup: Optional[Workload]) -> list[RequestRecord]:
        raise NotImplementedError

    def run_all(self, plan: Plan, on_outcome: OnOutcome) -> None:
        """Run each workload after its warm-up; report each outcome as soon as it is known."""
        for workload, warmup in plan:
            try:
                outcome: Outcome = self.run(workload, warmup)
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # one broken workload must not cost the others
                outcome = exc
            on_outcome(workload, outcome)
