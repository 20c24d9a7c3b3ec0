"""The bookkeeping side of a copy taken while a run is ending (worker/job_ending.py): a worker cut off
from Redis writes its results once Redis is back, after checking that each run is still in the started
registry. A run whose records are gone was dropped as taken by another worker, unless this worker took
the copy the sweep sent back (`claim_copy`): then nobody else runs the job, and the run stands. Each job
ends exactly once, whichever thread comes first. On a real Redis, with the RQ side recorded."""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from datetime import datetime, timezone
from types import SimpleNamespace

import redis

from schemas import GenerationResult, keys
from worker.gate import LoopGate
from worker.job_ending import Ending, JobEnding
from worker.output import EndedJob
from worker.settings import WorkerSettings

STARTED = "rq:wip:mlxq"


class InlineBookkeeper:
    gate = LoopGate()

    def submit(self, task, upkeep: bool = False) -> None:
        task()


@dataclass
class RecordedRQ:
    recorded_again: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    forgotten: list[str] = field(default_factory=list)

    def finish_successes(self, endings, pause) -> None:
        self.finished += [e.job_id for e in endings]

    def finish_failure(self, ending, result) -> None:
        raise AssertionError("no failures here")

    def requeue(self, ending, alone: bool) -> None:
        raise AssertionError("no requeues here")

    def record_again(self, endings) -> None:
        self.recorded_again += [e.job_id for e in endings]

    def forget(self, ending) -> None:
        self.forgotten.append(ending.job_id)


class CutOffSinceEveryStart:
    def lost_since(self, started_at: float) -> bool:
        return True


def ending_of(job_id: str) -> Ending:
    job = SimpleNamespace(id=job_id, origin="mlxq", started_at=datetime.now(timezone.utc), result_ttl=None,
                          func_name="worker.tasks.generate")
    execution = SimpleNamespace(composite_key=f"{job_id}:run")
    result = GenerationResult(id=job_id, status="finished", choices=[], worker="w")
    return Ending(EndedJob.built(result), job, None, execution, streams=False,  # type: ignore[arg-type]
                  callbacks_allowed=True, entry=object())


def make_ending(conn: redis.Redis) -> tuple[JobEnding, RecordedRQ]:
    registries = SimpleNamespace(started=lambda origin: SimpleNamespace(key=STARTED))
    rq = RecordedRQ()
    ending = JobEnding(conn, InlineBookkeeper(), rq, WorkerSettings(), "w",  # type: ignore[arg-type]
                       health=CutOffSinceEveryStart(), registries=registries)  # type: ignore[arg-type]
    return ending, rq


def ended(ending: JobEnding) -> list[str]:
    out = []
    while True:
        try:
            out.append(ending.done.get_nowait().job_id)
        except queue.Empty:
            return out


def test_a_run_whose_copy_was_taken_here_stands_and_is_recorded_again(redis_conn: redis.Redis) -> None:
    ending, rq = make_ending(redis_conn)
    redis_conn.zadd(STARTED, {"kept:run": 1})  # its records are there: no question
    assert ending.claim_copy("claimed")
    ending.hand_off([ending_of("claimed"), ending_of("kept")], [], {}, None)
    assert rq.recorded_again == ["claimed"] and sorted(rq.finished) == ["claimed", "kept"] and not rq.forgotten
    assert redis_conn.exists(keys.result_key("claimed"), keys.result_key("kept")) == 2
    assert sorted(ended(ending)) == ["claimed", "kept"]


def test_a_run_dropped_as_taken_leaves_the_copy_to_run(redis_conn: redis.Redis) -> None:
    ending, rq = make_ending(redis_conn)
    ending.hand_off([ending_of("taken")], [], {}, None)
    assert rq.forgotten == ["taken"] and not rq.finished and not rq.recorded_again
    assert not redis_conn.exists(keys.result_key("taken"))
    assert ended(ending) == ["taken"]
    assert not ending.claim_copy("taken")  # the loop runs the copy: the job's one run now
    ending.forget_marks("taken")
    assert ending.claim_copy("taken")  # a later run of the job starts with a clean slate
