"""The runner behind `mlxq batch`: an OpenAI Batch input file through the queue, with a bounded number of
jobs in flight, into an output file and an error file, resumable after an interruption.

Resuming: every line's job id is fixed by the input's contents, the output path and the line number, so
a second run with the same files knows its jobs. It skips the lines already written (by custom_id), waits
for the jobs of the first run that still exist (in a queue, running, or ended with their result kept),
and submits only the lines that have no job yet: no line runs twice while its first job's result lasts
(`result_ttl`, a day by default).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from rq.job import Job

from producer.batchfile import (MAX_FILE_BYTES, MAX_LINES, BatchLine, LineError, error_line, line_text, outcome_line,
                                parse_line, unreadable_line)
from producer.client import Client
from producer.errors import BrokerError, InvalidRequest, JobNotFound, MlxqError
from producer.wire import job_state, lost_result
from schemas import GenerationResult, keys

__all__ = ["BatchRun", "BatchRunSummary", "default_errors_path", "run_batch_file"]

BATCH_RESULT_TTL = 24 * 3600
POLL_S = 0.25  # how often the jobs in flight are read while none has ended


def default_errors_path(output: Path) -> Path:
    """`results.jsonl` -> `results.errors.jsonl`."""
    return output.with_name(f"{output.stem}.errors{output.suffix or '.jsonl'}")


@dataclass
class BatchRun:
    input: Path
    output: Path
    errors: Optional[Path] = None
    max_in_flight: int = 256
    priority: Optional[str] = None
    result_ttl: int = BATCH_RESULT_TTL
    job_timeout: Optional[int] = None

    def __post_init__(self) -> None:
        if self.errors is None:
            self.errors = default_errors_path(self.output)
        if self.max_in_flight < 1:
            raise InvalidRequest("max_in_flight: must be >= 1", "max_in_flight")


@dataclass
class BatchRunSummary:
    total: int = 0
    already_done: int = 0  # lines found in the output files at the start (a resumed run)
    already_failed: int = 0  # of those, the lines in the error file
    completed: int = 0  # lines of this run that went to the output file
    failed: int = 0  # lines of this run that went to the error file
    resumed_jobs: int = 0  # jobs of an earlier run this run waited for instead of submitting
    job_ids: list[str] = field(default_factory=list)  # the jobs this run submitted

    @property
    def ok(self) -> bool:
        """No line of the file failed, in this run or an earlier one."""
        return self.failed == 0 and self.already_failed == 0


def read_input(path: Path, limits: Any = None) -> tuple[list[BatchLine | LineError], str]:
    """Every non-empty line parsed, and the file's digest; InvalidRequest past OpenAI's limits or for a
    custom_id used twice."""
    data = path.read_bytes()
    if len(data) > MAX_FILE_BYTES:
        raise InvalidRequest(f"input: {len(data)} bytes exceeds the limit of {MAX_FILE_BYTES}", "input")
    parsed: list[BatchLine | LineError] = []
    seen: dict[str, int] = {}
    for number, text in enumerate(data.split(b"\n"), start=1):
        if not text.strip():
            continue
        if len(parsed) == MAX_LINES:
            raise InvalidRequest(f"input: more than {MAX_LINES} requests", "input")
        line = parse_line(text, number, limits)
        if line.custom_id is not None:
            if line.custom_id in seen:
                raise InvalidRequest(f"input: line {number}: custom_id {line.custom_id!r} is also on line "
                                     f"{seen[line.custom_id]}", "custom_id")
            seen[line.custom_id] = number
        parsed.append(line)
    return parsed, hashlib.sha256(data).hexdigest()


def written_custom_ids(path: Path) -> set[str]:
    """The custom_ids of the whole lines of an output or error file; a torn last line (the writer was
    killed mid-write) is cut off so the file can be appended to."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    whole = data[: data.rfind(b"\n") + 1]
    if len(whole) != len(data):
        with path.open("r+b") as handle:
            handle.truncate(len(whole))
    ids = set()
    for text in whole.splitlines():
        if text.strip():
            custom_id = json.loads(text).get("custom_id")
            if isinstance(custom_id, str):
                ids.add(custom_id)
    return ids


def job_id_for(run_tag: str, line: BatchLine) -> str:
    return f"mlxqbatch-{run_tag}-{line.number}"


class _Writer:
    """The two result files, appended to and flushed line by line."""

    def __init__(self, output: Path, errors: Path) -> None:
        self._files = {False: output.open("a", encoding="utf-8"), True: errors.open("a", encoding="utf-8")}

    def write(self, is_error: bool, line: dict[str, Any]) -> None:
        handle = self._files[is_error]
        handle.write(line_text(line) + "\n")
        handle.flush()

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()


def run_batch_file(client: Client, run: BatchRun, progress: Callable[[int], None] = lambda n: None,
                   on_start: Callable[[int, int], None] = lambda total, done: None) -> BatchRunSummary:
    """Run every line of `run.input` not yet in the result files. `on_start(total, done)` is called once
    the input is read, `progress(n)` as n more lines are written."""
    assert run.errors is not None
    lines, digest = read_input(run.input, client.limits)
    run_tag = hashlib.sha256(f"{digest}:{run.output.resolve()}".encode()).hexdigest()[:16]
    failed_before = written_custom_ids(run.errors)
    done = written_custom_ids(run.output) | failed_before
    summary = BatchRunSummary(total=len(lines), already_done=sum(1 for line in lines if line.custom_id in done),
                              already_failed=sum(1 for line in lines if line.custom_id in failed_before))
    on_start(summary.total, summary.already_done)
    writer = _Writer(run.output, run.errors)
    try:
        todo: list[BatchLine] = []
        for line in lines:
            if line.custom_id in done:
                continue
            if isinstance(line, LineError):
                writer.write(True, error_line(line.custom_id, line.code, line.message))
                summary.failed += 1
                progress(1)
            else:
                todo.append(line)
        _run_lines(client, run, run_tag, todo, writer, summary, progress)
    finally:
        writer.close()
    return summary


def _run_lines(client: Client, run: BatchRun, run_tag: str, todo: list[BatchLine], writer: _Writer,
               summary: BatchRunSummary, progress: Callable[[int], None]) -> None:
    pending = iter(todo)
    in_flight: dict[str, BatchLine] = {}
    exhausted = False
    while in_flight or not exhausted:
        room = run.max_in_flight - len(in_flight)
        if room > 0 and not exhausted:
            window = list(_take(pending, room))
            exhausted = len(window) < room
            _start(client, run, run_tag, window, in_flight, summary)
        ended = _ended(client, in_flight)
        for job_id, result in ended.items():
            line = in_flight.pop(job_id)
            try:
                if isinstance(result, Exception):
                    raise result
                is_error, out = outcome_line(line, job_id, result, int(time.time()))
                line_text(out)
            except Exception as exc:  # this line's result cannot be written: its error, not the run's end
                is_error, out = True, unreadable_line(line.custom_id, job_id, exc)
            writer.write(is_error, out)
            if is_error:
                summary.failed += 1
            else:
                summary.completed += 1
        if ended:
            progress(len(ended))
        elif in_flight:
            time.sleep(POLL_S)


def _take(items: Iterator[BatchLine], count: int) -> Iterable[BatchLine]:
    for _ in range(count):
        try:
            yield next(items)
        except StopIteration:
            return


def _start(client: Client, run: BatchRun, run_tag: str, window: list[BatchLine], in_flight: dict[str, BatchLine],
           summary: BatchRunSummary) -> None:
    """Submit the lines of `window` that have no job yet; adopt the jobs an earlier run left."""
    if not window:
        return
    ids = [job_id_for(run_tag, line) for line in window]
    with client.connection.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.exists(Job.key_for(job_id), keys.result_key(job_id))
        known = pipe.execute()
    fresh = [(job_id, line) for job_id, line, exists in zip(ids, window, known) if not exists]
    summary.resumed_jobs += len(window) - len(fresh)
    if fresh:
        client.submit_many([line.request for _, line in fresh], job_ids=[job_id for job_id, _ in fresh],
                           priority=run.priority, result_ttl=run.result_ttl, timeout=run.job_timeout)
        summary.job_ids.extend(job_id for job_id, _ in fresh)
    in_flight.update(zip(ids, window))


def _ended(client: Client, in_flight: dict[str, BatchLine]) -> dict[str, GenerationResult | Exception]:
    """The jobs in flight that have ended, with their results (RQ's stand-in for one that lost it), or
    why a result that is there cannot be read."""
    ended: dict[str, GenerationResult | Exception] = {}
    ids = list(in_flight)
    for start in range(0, len(ids), 512):
        chunk = ids[start : start + 512]
        with client.connection.pipeline(transaction=False) as pipe:
            for job_id in chunk:
                pipe.get(keys.result_key(job_id))
                pipe.hget(Job.key_for(job_id), "status")
            raw = pipe.execute()
        for i, job_id in enumerate(chunk):
            result: GenerationResult | Exception | None
            try:
                result = client._settled(job_state(job_id, raw[2 * i], raw[2 * i + 1]))
            except JobNotFound:
                result = lost_result(job_id)
            except BrokerError:
                raise
            except MlxqError as exc:  # a malformed result
                result = exc
            if result is not None:
                ended[job_id] = result
    return ended

