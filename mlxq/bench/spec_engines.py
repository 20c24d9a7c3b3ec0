"""The speculative scenario's arms as engines in the bench's own process (`--spec-in-process`).

Each arm's scheduler and engine are built from the MLXQ_* settings its worker would get
(worker/loading.py), every shape compiled before the first run, and driven as SchedulerArm drives
its own (arm_local.drive_scheduler): no Redis, RQ or worker loop. Two worker processes without speculation differ
by more than the margins that matter here (the `control` arm, docs/performance.md#in-one-process);
engines in one process share one Python, one allocator and the same cores, so a pair of them
differs less. What a queue adds around the engine is the same with and without speculation.
"""

from __future__ import annotations

import gc
import time
from typing import Any, Callable

from mlxq.bench.workloads import BenchRequest, RequestRecord, Workload


class EngineArm:
    """One arm's BatchScheduler and engine in this process, with the calls the scenario makes of a
    worker cluster: start, warm, drive, its time counters and CPU seconds, stop."""

    def __init__(self, env: dict[str, str], model_path: str, max_num_seqs: int) -> None:
        self.env = {**env, "MLXQ_MAX_NUM_SEQS": str(max_num_seqs), "MLXQ_DECODE_WARMUP": "blocking"}
        self.model_path = model_path
        self.scheduler: Any = None

    def start(self) -> None:
        from worker.loading import build_scheduler
        from worker.settings import WorkerSettings

        self.scheduler = build_scheduler(WorkerSettings.from_env(self.env, model=self.model_path))
        self.scheduler.queue_seen(False)  # a worker's queues would hold no more than the requests driven here

    def stop(self) -> None:
        if self.scheduler is None:
            return
        import mlx.core as mx

        self.scheduler = None  # (blocking warm-up: no background kernel build to stop)
        gc.collect()
        mx.clear_cache()

    def warm(self, workload: Workload) -> None:
        """Run `workload` as a worker cluster's warm-up does (arm_mlxq.payload: EOS ignored)."""
        from mlxq.bench.arm_mlxq import payload

        self.drive(workload, payload)

    def drive(self, workload: Workload, make_payload: Callable[[BenchRequest], dict[str, Any]]
              ) -> list[RequestRecord]:
        """Every request of `workload` admitted as it arrives and stepped to its end, in index order;
        each record holds its token ids and the speculation its result reports (extra["token_ids"],
        extra["speculation"])."""
        from mlxq.bench.arm_local import drive_scheduler

        return sorted(drive_scheduler(self.scheduler, workload, make_payload), key=lambda r: r.index)

    def time_counters(self) -> dict[str, float]:
        """The engine's time and speculation counters, named as a worker publishes them (`engine_*`)."""
        engine = self.scheduler.engine
        speculation = {k: v for k, v in engine.stats().counters.items() if k.startswith("speculative_")}
        return {f"engine_{name}": float(value) for name, value in {**engine.time_stats(), **speculation}.items()}

    def pass_costs(self) -> dict[str, float]:
        """What the arm's speculator has measured of its passes and early read-backs, in decode steps
        (pass_cost.PassCosts.learnt; empty without speculation), and the graded policy's share of
        rows ending early for each kind of row (graded.EarlyEndings)."""
        speculator = getattr(self.scheduler.engine, "speculator", None)  # the compiled engine's
        if speculator is None:
            return {}
        endings = getattr(speculator, "endings", None)
        shares = endings.shares() if endings is not None else {}
        return {**speculator.costs.learnt(), **{f"ending early, {kind}": share for kind, share in shares.items()}}

    def cpu_s(self) -> float:
        """This process's CPU seconds: one arm runs at a time, so a run's difference is its own."""
        return time.process_time()
