"""`python -m mlxq.bench.fake_worker --url U --max-num-seqs N QUEUE...`: a real BatchWorker whose
engine is mlxq's zero-cost FakeEngine, optionally given a fixed cost per step (a sleep standing in
for a decode step). It logs the start time, the active count and whether the worker's bookkeeping
(result keys, RQ's job endings) was still busy at every engine step, written as JSON to --step-log
when the worker stops (SIGTERM: RQ's warm shutdown).

What it measures is the queue's own cost: RQ bookkeeping, result publishing, admission.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Callable, Optional


from schemas import broker
from worker import BatchWorker, WorkerSettings
from worker.engines.base import TokenEvent
from worker.engines.fake import FakeEngine
from worker.scheduler import BatchScheduler


class TimedFakeEngine(FakeEngine):
    def __init__(self, step_s: float) -> None:
        super().__init__()
        self.step_s = step_s
        self.log: list[tuple[float, int, bool]] = []
        self.bookkeeping_busy: Callable[[], bool] = lambda: False

    def step(self) -> list[TokenEvent]:
        self.log.append((time.perf_counter(), self.num_active, self.bookkeeping_busy()))
        if self.step_s > 0:
            time.sleep(self.step_s)
        return super().step()


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mlxq.bench.fake_worker")
    parser.add_argument("queues", nargs="+")
    parser.add_argument("--url", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--step-ms", type=float, default=0.0)
    parser.add_argument("--step-log")
    parser.add_argument("--metrics-port", type=int)
    parser.add_argument("--durable-results", type=int, default=0, help="replicas each result batch waits for")
    args = parser.parse_args(argv)

    engine = TimedFakeEngine(args.step_ms / 1000.0)
    settings = WorkerSettings(max_num_seqs=args.max_num_seqs, metrics_port=args.metrics_port,
                              durable_results=args.durable_results)

    def scheduler_factory(settings: WorkerSettings, name: str) -> Any:
        return BatchScheduler(engine, max_num_seqs=args.max_num_seqs, limits=settings.limits, worker_name=name)

    worker = BatchWorker(args.queues, connection=broker.connect(args.url), settings=settings,
                         scheduler_factory=scheduler_factory, name=args.name)
    engine.bookkeeping_busy = lambda: not worker.bookkeeping_idle
    try:
        worker.work(logging_level="WARNING")
    finally:
        if args.step_log:
            Path(args.step_log).write_text(json.dumps(engine.log))


if __name__ == "__main__":
    main()
