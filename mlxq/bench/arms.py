"""What every arm offers the runner: start, run a workload (after a warm-up pass), stop."""

from __future__ import annotations

from typing import Any, Optional, Union

from mlxq.bench.workloads import RequestRecord, Workload

Outcome = Union[list[RequestRecord], BaseException]


class ArmSkipped(Exception):
    """The arm cannot run here; the message says why (it goes into the report)."""


class Arm:
    key = "?"
    label = "?"
    # How this arm's queue time and TTFT are measured: goes into the report verbatim.
    methods: dict[str, str] = {}

    def start(self) -> None:
        """Load models, start processes. May raise ArmSkipped."""

    def stop(self) -> None:
        """Stop everything `start` started; must be safe to call twice."""

    def info(self) -> dict[str, Any]:
        return {}

    def run(self, workload: Workload, warmup: Optional[Workload]) -> list[RequestRecord]:
        raise NotImplementedError

    def run_all(self, plan: list[tuple[Workload, Optional[Workload]]]) -> list[Outcome]:
        outcomes: list[Outcome] = []
        for workload, warmup in plan:
            try:
                outcomes.append(self.run(workload, warmup))
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # one broken workload must not cost the others
                outcomes.append(exc)
        return outcomes
