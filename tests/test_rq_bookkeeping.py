"""The worker's batched RQ writes (job start and end, several at once) leave Redis as rq's own
per-job path does, and keep rq's semantics: dependents, queue priority."""

from __future__ import annotations

import base64
import json
import re

import pytest
import redis
from rq import Queue, Retry
from rq.job import Job, JobStatus
from rq.registry import FinishedJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer

from schemas import keys
from tests.workers import run_rq_worker

pytestmark = pytest.mark.slow

FAKE = {"MLXQ_ENGINE": "fake", "MLXQ_FAKE_STEP_DELAY_S": "0.005"}


def request(i: int, max_tokens: int = 4) -> dict:
    return {"prompt_token_ids": [1 + i % 200, 2, 3], "max_tokens": max_tokens, "ignore_eos": True}


def enqueue(conn: redis.Redis, queue: str, payloads: list[dict], **kwargs) -> list[Job]:
    q = Queue(queue, connection=conn, serializer=JSONSerializer)
    return [q.enqueue(keys.JOB_FUNCTION, request=p, **kwargs) for p in payloads]


def redis_state(conn: redis.Redis, job: Job) -> dict:
    """What Redis holds about one ended job, with its id (and execution ids) masked out."""
    names = sorted(re.sub(r"[0-9a-f]{32}", "<exec>", k.decode().replace(job.id, "<job>"))
                   for k in conn.scan_iter(match=f"*{job.id}*"))
    queue = Queue(job.origin, connection=conn, serializer=JSONSerializer)
    fetched = Job.fetch(job.id, connection=conn, serializer=JSONSerializer)
    return {
        "keys": names,
        "job_fields": sorted(f.decode() for f in conn.hkeys(job.key)),
        "status": fetched.get_status(),
        "ended": fetched.ended_at is not None and fetched.started_at is not None,
        "finished_registry": job.id in FinishedJobRegistry(queue=queue).get_job_ids(),
        "started_registry": job.id in StartedJobRegistry(queue=queue).get_job_ids(),
        "job_ttl_set": 0 < conn.ttl(job.key) <= keys.DEFAULT_RESULT_TTL,
        "results": conn.xlen(f"rq:results:{job.id}"),
        "return_value_is_the_result": fetched.return_value() == json.loads(conn.get(keys.result_key(job.id))),
    }


def test_batched_endings_leave_redis_as_rq_does(redis_url):
    conn = redis.Redis.from_url(redis_url)
    # 256 end in one step: several Redis calls' worth of endings (RQ_ENDS_PER_CALL, RESULTS_PER_CALL)
    ours = enqueue(conn, "bk-batch", [request(i, max_tokens=12) for i in range(300)], result_ttl=keys.DEFAULT_RESULT_TTL)
    stock = enqueue(conn, "bk-stock", [request(0)], result_ttl=keys.DEFAULT_RESULT_TTL)
    done = run_rq_worker(redis_url, "worker.BatchWorker", ["bk-batch"], {**FAKE, "MLXQ_MAX_NUM_SEQS": "256"})
    assert done.returncode == 0, done.stderr
    done = run_rq_worker(redis_url, "rq.SimpleWorker", ["bk-stock"], FAKE)
    assert done.returncode == 0, done.stderr

    reference = redis_state(conn, stock[0])
    assert reference["status"] == JobStatus.FINISHED and reference["results"] == 1
    for job in ours:
        assert redis_state(conn, job) == reference
        # rq's stored return value is the result key's own text, not a second encoding of it.
        ((_, entry),) = conn.xrevrange(f"rq:results:{job.id}", count=1)
        assert base64.b64decode(entry[b"return_value"]) == conn.get(keys.result_key(job.id))
    worker_keys = [k for k in conn.scan_iter(match="rq:worker:*") if conn.type(k) == b"hash"]
    counts = sorted(int(conn.hget(k, "successful_job_count") or 0) for k in worker_keys)
    assert len(ours) in counts


def test_a_job_with_dependents_enqueues_them_when_it_ends(redis_url):
    conn = redis.Redis.from_url(redis_url)
    parent, *crowd = enqueue(conn, "bk-deps", [request(i, max_tokens=6) for i in range(8)])
    child = Queue("bk-deps", connection=conn, serializer=JSONSerializer).enqueue(
        keys.JOB_FUNCTION, request=request(99), depends_on=parent)
    assert child.get_status() == JobStatus.DEFERRED
    done = run_rq_worker(redis_url, "worker.BatchWorker", ["bk-deps"], FAKE)
    assert done.returncode == 0, done.stderr
    for job in [parent, *crowd, child]:
        assert job.get_status(refresh=True) == JobStatus.FINISHED, job.id
    child.refresh()
    parent.refresh()
    assert child.started_at >= parent.ended_at


def test_several_queues_are_taken_in_priority_order(redis_url):
    conn = redis.Redis.from_url(redis_url)
    low = enqueue(conn, "bk-low", [request(i) for i in range(6)])
    high = enqueue(conn, "bk-high", [request(i) for i in range(6)])
    done = run_rq_worker(redis_url, "worker.BatchWorker", ["bk-high", "bk-low"], {**FAKE, "MLXQ_MAX_NUM_SEQS": "2"})
    assert done.returncode == 0, done.stderr
    for job in low + high:
        job.refresh()
        assert job.get_status() == JobStatus.FINISHED
        assert conn.lrange(Queue(job.origin, connection=conn).intermediate_queue.key, 0, -1) == []
    assert max(j.started_at for j in high) <= min(j.started_at for j in low)


def test_a_job_deleted_while_it_waits_is_dropped_and_the_rest_run(redis_url):
    conn = redis.Redis.from_url(redis_url)
    jobs = enqueue(conn, "bk-gone", [request(i) for i in range(5)])
    gone = jobs[2]
    conn.delete(gone.key)  # its id stays in the queue list
    done = run_rq_worker(redis_url, "worker.BatchWorker", ["bk-gone"], FAKE)
    assert done.returncode == 0, done.stderr
    for job in jobs:
        if job is not gone:
            assert job.get_status(refresh=True) == JobStatus.FINISHED
    queue = Queue("bk-gone", connection=conn)
    assert conn.lrange(queue.key, 0, -1) == [] and conn.lrange(queue.intermediate_queue.key, 0, -1) == []
    assert not conn.exists(gone.key) and conn.get(keys.result_key(gone.id)) is None


def test_live_workers_sweeping_at_once_send_a_dead_workers_job_back_once(redis_url):
    """Three live workers whose sweeps run at the same moment (as they do when started together) find
    the same expired jobs of a dead worker: each job goes back on its queue once, its hash is written
    by one of them, and none of the sweeps can rewrite the hash of a job another worker took meanwhile."""
    import threading
    import time

    from worker.recovery import Housekeeping
    from worker.settings import WorkerSettings

    conn = redis.Redis.from_url(redis_url)
    jobs = enqueue(conn, "bk-sweep", [request(i) for i in range(40)], retry=Retry(max=2))
    queue = Queue("bk-sweep", connection=conn, serializer=JSONSerializer)
    conn.delete(queue.key)
    registry = StartedJobRegistry(queue=queue)
    with conn.pipeline() as pipe:
        for job in jobs:  # started by a worker named "dead", whose heartbeats lapsed 10 s ago
            pipe.hset(job.key, mapping={"status": "started", "worker_name": "dead"})
            pipe.zadd(registry.key, {f"{job.id}:exec-{job.id[:8]}": time.time() - 10})
        pipe.execute()
    settings = WorkerSettings(engine="fake")
    start = threading.Barrier(3)

    def sweep() -> None:
        own = redis.Redis.from_url(redis_url)
        housekeeping = Housekeeping(own, [Queue("bk-sweep", connection=own, serializer=JSONSerializer)], settings,
                                    refuse=lambda refused: None)
        start.wait()
        housekeeping.sweep(frozenset())

    sweepers = [threading.Thread(target=sweep) for _ in range(3)]
    for thread in sweepers:
        thread.start()
    for thread in sweepers:
        thread.join(timeout=60)
    queued = [raw.decode() for raw in conn.lrange(queue.key, 0, -1)]
    assert sorted(queued) == sorted(job.id for job in jobs), f"{len(queued)} ids queued for {len(jobs)} jobs"
    assert registry.get_job_ids() == []
    for job in jobs:
        fetched = Job.fetch(job.id, connection=conn, serializer=JSONSerializer)
        assert fetched.get_status() == JobStatus.QUEUED and fetched.retries_left == 1
