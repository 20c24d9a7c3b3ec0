"""`mlxq info`: queues, registries and workers, read with the JSON serializer.

`rq info` cleans registries with RQ's default pickle serializer, which rewrites a JSON job's
meta as `{'unserialized': ...}` when it touches one; this reads and cleans the same registries
the safe way, and writes the result keys of dead workers' jobs as workers do.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import redis
from rq import Queue, Worker
from rq.registry import (
    CanceledJobRegistry,
    DeferredJobRegistry,
    FailedJobRegistry,
    FinishedJobRegistry,
    ScheduledJobRegistry,
    StartedJobRegistry,
)

from mlxq.producer_commands import URL_PASSWORD_NOTE
from producer.wire import resolve_url
from schemas import broker, keys
from schemas.serializer import JSON_SERIALIZER

REGISTRIES = {
    "started": StartedJobRegistry,
    "finished": FinishedJobRegistry,
    "failed": FailedJobRegistry,
    "deferred": DeferredJobRegistry,
    "scheduled": ScheduledJobRegistry,
    "canceled": CanceledJobRegistry,
}


def collect(connection: redis.Redis, queue_names: list[str], cleanup: bool) -> dict[str, Any]:
    queues = [Queue(name, connection=connection, serializer=JSON_SERIALIZER) for name in queue_names] or \
        Queue.all(connection=connection, serializer=JSON_SERIALIZER)
    swept: list[str] = []
    if cleanup:
        from worker.recovery import SWEEP_LOCK_TTL_S, sweep_abandoned, sweep_lock
        from worker.settings import WorkerSettings

        with sweep_lock(connection, wait_s=SWEEP_LOCK_TTL_S) as held:
            if not held:
                raise SystemExit(f"a worker has held the sweep lock ({keys.SWEEP_LOCK_KEY}) for {SWEEP_LOCK_TTL_S} s; "
                                 "try again")
            swept = sweep_abandoned(connection, queues, WorkerSettings.from_env())
    report: dict[str, Any] = {"queues": {}, "workers": [], "recovered_jobs": swept}
    for queue in queues:
        counts = {"queued": queue.count}
        for name, registry_class in REGISTRIES.items():
            registry = registry_class(queue.name, connection=connection, serializer=JSON_SERIALIZER)
            counts[name] = registry.get_job_count(cleanup=cleanup)
        report["queues"][queue.name] = counts
    for worker in Worker.all(connection=connection, serializer=JSON_SERIALIZER):
        report["workers"].append({
            "name": worker.name,
            "state": str(worker.get_state()),
            "queues": worker.queue_names(),
            "last_heartbeat": worker.last_heartbeat.isoformat() if worker.last_heartbeat else None,
            "successful_jobs": worker.successful_job_count,
            "failed_jobs": worker.failed_job_count,
        })
    report["result_keys"] = sum(1 for _ in connection.scan_iter(match=keys.result_key("*"), count=1000))
    return report


def print_report(report: dict[str, Any]) -> None:
    columns = ["queued", *REGISTRIES]
    print(f"{'queue':<32}" + "".join(f"{c:>10}" for c in columns))
    for name, counts in report["queues"].items():
        print(f"{name:<32}" + "".join(f"{counts[c]:>10}" for c in columns))
    print(f"\n{len(report['workers'])} worker(s)")
    for worker in report["workers"]:
        print(f"  {worker['name']:<30} {worker['state']:<10} {','.join(worker['queues'])}  "
              f"ok={worker['successful_jobs']} failed={worker['failed_jobs']}")
    print(f"\n{report['result_keys']} result key(s)")
    if report["recovered_jobs"]:
        print(f"recovered {len(report['recovered_jobs'])} job(s) of dead workers: {report['recovered_jobs']}")


def cmd_info(args: argparse.Namespace) -> int:
    connection = broker.connect(resolve_url(args.url))
    report = collect(connection, args.queues, args.cleanup)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0


def register(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    parser = subparsers.add_parser(
        "info",
        help="queues, registries and workers (a JSON-safe `rq info`)",
        description="Show queue sizes, registry counts and workers, reading jobs as JSON. With --cleanup, "
        "also retry or fail the jobs of dead workers (writing their result keys) and prune expired registry "
        "entries: the safe replacement for `rq info`, whose cleanup rewrites JSON jobs' meta through pickle.",
    )
    parser.add_argument("queues", nargs="*", help="queues to show (default: all)")
    parser.add_argument("--url", help=f"Redis URL (default: $MLXQ_REDIS_URL; {URL_PASSWORD_NOTE})")
    parser.add_argument("--cleanup", action="store_true", help="recover dead workers' jobs and prune registries")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=cmd_info)
