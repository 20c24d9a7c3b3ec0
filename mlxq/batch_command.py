"""`mlxq batch -i requests.jsonl -o results.jsonl`: an OpenAI Batch file through the queue (producer/batchrun.py).

Exit codes: 0 every line finished, 1 some line failed or another error, 2 invalid input, 130 interrupted
(run the same command again to resume).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from producer import Client, InvalidRequest, MlxqError
from producer.batchrun import BATCH_RESULT_TTL, BatchRun, default_errors_path, run_batch_file
from producer.wire import URL_ENV

__all__ = ["register"]


def register(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = subparsers.add_parser(
        "batch", help="run an OpenAI Batch JSONL file through the queue",
        description="Run every request of an OpenAI Batch input file (lines for /v1/chat/completions or "
        "/v1/completions) through the queue, writing OpenAI Batch output lines to -o and failed lines to "
        "--errors. Interrupted, the same command resumes: finished lines are not run again.")
    p.add_argument("-i", "--input", type=Path, required=True, help="OpenAI Batch input JSONL")
    p.add_argument("-o", "--output", type=Path, required=True, help="output JSONL (appended to when resuming)")
    p.add_argument("--errors", type=Path, help="error JSONL (default: OUTPUT with .errors before its suffix)")
    p.add_argument("--url", default=os.environ.get(URL_ENV),
                   help=f"Redis URL (default: ${URL_ENV}, else redis://127.0.0.1:6379/0)")
    p.add_argument("--max-in-flight", type=int, default=256, help="jobs submitted and not yet ended, at most (256)")
    p.add_argument("--priority", help="priority queue for the jobs (e.g. low; docs/producer.md)")
    p.add_argument("--result-ttl", type=int, default=BATCH_RESULT_TTL,
                   help="seconds a job's result is kept, so an interrupted run can pick it up (default a day)")
    p.add_argument("--job-timeout", type=int, help="RQ job timeout in seconds")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    bars: list[tqdm] = []

    def on_start(total: int, done: int) -> None:
        bars.append(tqdm(total=total, initial=done, unit="req", disable=args.no_progress, file=sys.stderr,
                         dynamic_ncols=True))

    def progress(count: int) -> None:
        bars[0].update(count)

    try:
        run = BatchRun(args.input, args.output, args.errors, max_in_flight=args.max_in_flight,
                       priority=args.priority, result_ttl=args.result_ttl, job_timeout=args.job_timeout)
        with Client(args.url) as client:
            summary = run_batch_file(client, run, progress=progress, on_start=on_start)
    except InvalidRequest as exc:
        _close(bars)
        print(f"mlxq batch: {exc}", file=sys.stderr)
        return 2
    except (MlxqError, OSError) as exc:
        _close(bars)
        print(f"mlxq batch: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        _close(bars)
        print("mlxq batch: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    _close(bars)
    errors = args.errors or default_errors_path(args.output)
    print(f"mlxq batch: {summary.completed} completed, {summary.failed} failed"
          + (f", {summary.already_done} already done ({summary.already_failed} of them failed)"
             if summary.already_done else "")
          + (f", {summary.resumed_jobs} jobs of an earlier run picked up" if summary.resumed_jobs else "")
          + (f"; errors in {errors}" if not summary.ok else ""), file=sys.stderr)
    return 0 if summary.ok else 1


def _close(bars: list) -> None:
    for bar in bars:
        bar.close()
