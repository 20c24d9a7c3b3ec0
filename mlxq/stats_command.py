"""`mlxq stats [--watch] [--json]`: the fleet at a glance (producer/fleet_stats.py): queues with their
depth and oldest job's age, live workers with their model, jobs and sequences in flight, tokens/s over
the last minute, prefix-cache hit rate, and failures by type."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Optional

import redis
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from mlxq.producer_commands import URL_PASSWORD_NOTE
from producer.fleet_stats import FleetSnapshot, read_snapshot
from producer.wire import redact_url, resolve_url
from schemas import broker

__all__ = ["register", "render"]


def _age(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def render(snapshot: FleetSnapshot) -> Group:
    queues = Table(title="Queues", title_justify="left")
    for column in ("queue", "waiting", "oldest", "started", "failed", "workers"):
        queues.add_column(column, justify="left" if column in ("queue", "workers") else "right")
    for q in snapshot.queues:
        flag = "[bold red]NONE LIVE[/]" if q.unserved else ("yes" if q.served else "none")
        queues.add_row(q.name, str(q.depth), _age(q.oldest_age_s), str(q.started), str(q.failed), flag)

    workers = Table(title=f"Live workers ({len(snapshot.workers)})", title_justify="left")
    for column in ("worker", "model", "host", "jobs", "seqs", "tok/s 1m", "prefix hit", "finished", "failed",
                   "cancelled"):
        workers.add_column(column, justify="left" if column in ("worker", "model", "host") else "right")
    for w in snapshot.workers:
        hit = "-" if w.prefix_cache_hit_rate is None else f"{100 * w.prefix_cache_hit_rate:.0f}%"
        workers.add_row(w.name, w.model, w.host, str(w.running), f"{w.sequences}/{w.max_num_seqs}",
                        f"{w.tokens_per_s_1m:.1f}", hit, str(w.jobs_finished), str(sum(w.failures.values())),
                        str(w.jobs_cancelled))

    failures = Table(title="Failures by type", title_justify="left")
    failures.add_column("error type")
    failures.add_column("jobs", justify="right")
    for error_type, count in snapshot.failures.items():
        failures.add_row(error_type, str(count))
    models = ", ".join(f"{model or '?'} x{count}" for model, count in snapshot.models.items()) or "none"
    summary = (f"models: {models}; jobs in flight {snapshot.in_flight}; "
               f"{snapshot.tokens_per_s:.1f} tokens/s over the last minute; {snapshot.cancelled} cancelled; "
               f"{snapshot.queues_registered} queues registered, {snapshot.queues_with_jobs} holding jobs")
    if snapshot.unserved:
        summary += ("\n[bold red]jobs wait with no live worker on: " + ", ".join(snapshot.unserved)
                    + "[/] (they run when one comes, unless their TTL ends first)")
    return Group(queues, workers, failures, summary)


def cmd_stats(args: argparse.Namespace) -> int:
    url = resolve_url(args.url)
    connection = broker.connect(url)
    queues = tuple(args.queues)
    console = Console()
    try:
        if args.json:
            while True:
                print(json.dumps(read_snapshot(connection, queues).to_json()), flush=True)
                if not args.watch:
                    return 0
                time.sleep(args.interval)
        if not args.watch:
            console.print(render(read_snapshot(connection, queues)))
            return 0
        with Live(render(read_snapshot(connection, queues)), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(args.interval)
                live.update(render(read_snapshot(connection, queues)), refresh=True)
    except KeyboardInterrupt:
        return 0
    except redis.RedisError as exc:
        print(f"mlxq stats: {redact_url(url)}: {exc}", file=sys.stderr)
        return 1


def register(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    parser = subparsers.add_parser(
        "stats", help="queues, live workers, tokens/s and failures (the fleet at a glance)",
        description="Queues with their depth and oldest job's age, live workers with their model, jobs and "
                    "sequences in flight, tokens/s over the last minute, prefix-cache hit rate, and failures by "
                    "error type. Reads Redis only (docs/operations.md).")
    parser.add_argument("queues", nargs="*", help="queues to show (default: every queue RQ knows or a worker serves)")
    parser.add_argument("--url", help=f"Redis URL (default: $MLXQ_REDIS_URL; {URL_PASSWORD_NOTE})")
    parser.add_argument("--json", action="store_true", help="one JSON object (with --watch: one a line)")
    parser.add_argument("--watch", action="store_true", help="refresh until interrupted")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default 2)")
    parser.set_defaults(func=cmd_stats)
