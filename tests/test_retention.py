"""How long a job's records stay in Redis once it ended, on a real redis-server with real worker
processes: a failed or cancelled job (its hash, which holds the whole request, its `rq:results:<id>`
entry, its failed-registry entry) is kept as long as its result key, never RQ's default of a year, by
whatever path it ended: a failure in the worker, a cancel while running or queued, a dead worker, a
job enqueued by plain rq without mlxq's options, a gateway job (MLXQ_API_RESULT_TTL)."""

from __future__ import annotations

import time

import httpx
import pytest
import redis
from rq import Queue
from rq.registry import FailedJobRegistry

from producer import Client
from schemas import keys
from schemas.serializer import JSON_SERIALIZER
from tests.gateway import key_entry, running_gateway, wait_live
from tests.workers import start_fake_worker, stop, wait_for

pytestmark = pytest.mark.slow

TTL = 120
YEAR = 365 * 24 * 3600


def _kept(conn: redis.Redis, job_id: str, ttl: int) -> dict[str, int]:
    """The TTLs of the job's records that exist and live longer than `ttl` (or forever): none, if kept right."""
    records = {"hash": f"rq:job:{job_id}", "rq results": f"rq:results:{job_id}",
               "result key": keys.result_key(job_id)}
    found = {name: conn.ttl(key) for name, key in records.items()}
    return {name: left for name, left in found.items() if left != -2 and not 0 < left <= ttl}


def _failed_registry_expiry(conn: redis.Redis, queue: str, job_id: str) -> float | None:
    score = conn.zscore(FailedJobRegistry(queue, connection=conn, serializer=JSON_SERIALIZER).key, job_id)
    return None if score is None else score - time.time()


def test_failed_and_cancelled_jobs_are_kept_as_long_as_their_result(redis_url: str, redis_conn: redis.Redis) -> None:
    client = Client(redis_url)
    cancelled_queued = client.submit({"prompt": "q", "max_tokens": 5}, result_ttl=TTL)
    assert client.cancel(cancelled_queued)
    timed_out = client.submit({"prompt": "t", "max_tokens": 4000}, result_ttl=TTL, timeout=1)
    cancelled_running = client.submit({"prompt": "c", "max_tokens": 4000}, result_ttl=TTL)
    finished = client.submit({"prompt": "f", "max_tokens": 3}, result_ttl=TTL)
    # Plain rq, without mlxq's producer: no failure_ttl in the hash; the worker keeps it as long as the result.
    plain = Queue("mlxq", connection=redis_conn, serializer=JSON_SERIALIZER).enqueue(
        keys.JOB_FUNCTION, request={"prompt": "p", "max_tokens": 4000}, result_ttl=90, job_timeout=1).id
    assert redis_conn.hget(f"rq:job:{plain}", "failure_ttl") is None
    worker = start_fake_worker(redis_url, step_delay_s=0.02)
    try:
        wait_for(lambda: client.status(cancelled_running) == "started", timeout=60, what="the job to start")
        assert client.cancel(cancelled_running)
        results = client.wait_many([timed_out, cancelled_running, finished, plain], timeout=60)
        wait_for(lambda: all(redis_conn.hget(f"rq:job:{j}", "status") in (b"failed", b"stopped")
                             for j in (timed_out, cancelled_running, plain)), timeout=30, what="RQ's bookkeeping")
    finally:
        out = stop(worker)
    assert [results[j].status for j in (timed_out, cancelled_running, finished, plain)] == [
        "failed", "cancelled", "finished", "failed"], out
    for job_id in (cancelled_queued, timed_out, cancelled_running, finished):
        assert _kept(redis_conn, job_id, TTL) == {}, (job_id, out)
    assert _kept(redis_conn, plain, 90) == {}, out
    assert redis_conn.exists(f"rq:results:{timed_out}") and redis_conn.exists(f"rq:results:{plain}")
    for job_id, ttl in ((timed_out, TTL), (plain, 90)):
        expiry = _failed_registry_expiry(redis_conn, "mlxq", job_id)
        assert expiry is not None and expiry <= ttl, expiry


def test_a_dead_workers_job_is_kept_as_long_as_its_result(redis_url: str, redis_conn: redis.Redis) -> None:
    """A job whose worker was killed, without retries: the sweep of another worker fails it (rq's own
    cleanup does the failed registry), and its records expire with its result."""
    client = Client(redis_url)
    doomed = client.submit({"prompt_token_ids": [1, 2], "max_tokens": 4000}, result_ttl=TTL)
    victim = start_fake_worker(redis_url, name="victim", step_delay_s=0.05)
    wait_for(lambda: client.status(doomed) == "started", timeout=60, what="the job to start")
    victim.kill()
    victim.wait()
    rescuer = start_fake_worker(redis_url, name="rescuer")
    try:
        result = client.wait(doomed, timeout=90)
        wait_for(lambda: redis_conn.hget(f"rq:job:{doomed}", "status") == b"failed", timeout=30,
                 what="rq's cleanup")
    finally:
        out = stop(rescuer)
    assert result.status == "failed" and result.error is not None and result.error.type == "AbandonedJobError", out
    assert _kept(redis_conn, doomed, TTL) == {}, out
    expiry = _failed_registry_expiry(redis_conn, "mlxq", doomed)
    assert expiry is not None and expiry <= TTL, expiry


def test_a_gateway_jobs_records_follow_its_result_ttl(redis_url: str, redis_conn: redis.Redis) -> None:
    worker = start_fake_worker(redis_url, "--model", "fake", step_delay_s=0.02)
    try:
        wait_live(redis_conn, "fake")
        with running_gateway(redis_url, api_keys=key_entry("acme", "sk-acme-ttl"), result_ttl=TTL) as base:
            headers = {"Authorization": "Bearer sk-acme-ttl"}
            job = httpx.post(f"{base}/jobs", headers=headers, timeout=30,
                             json={"model": "fake", "prompt": "x", "max_tokens": 4000}).json()["id"]
            wait_for(lambda: httpx.get(f"{base}/jobs/{job}", headers=headers, timeout=30).json()["status"] == "started",
                     timeout=60, what="the job to start")
            assert httpx.delete(f"{base}/jobs/{job}", headers=headers, timeout=30).json()["cancelled"] is True
            wait_for(lambda: redis_conn.hget(f"rq:job:{job}", "status") == b"stopped", timeout=60,
                     what="the cancel to end the job")
    finally:
        out = stop(worker)
    assert redis_conn.hget(f"rq:job:{job}", "failure_ttl") == str(TTL).encode()
    assert _kept(redis_conn, job, TTL) == {}, out
    assert redis_conn.ttl(f"rq:job:{job}") < YEAR
