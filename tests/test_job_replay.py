"""A job runs once, and its first result stays: a hostile producer holding the documented ACL
(docs/operations.md) rewrites ended jobs' hashes and pushes their ids back on a queue, in every way
it can, next to a real worker and good traffic; no ended job runs again, no result key changes by a
byte, the worker lives, and the good jobs finish. A worker that was given up for dead and comes back
later does not replace the result the sweep wrote."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rq import Queue, Retry

from mlxq.redis_server import RedisServer, find_redis_server
from producer import Client
from schemas import keys
from schemas.serializer import JSON_SERIALIZER
from tests.test_hostile_jobs import drain, leftovers, plant, good_fields
from tests.test_security import PRODUCER_ACL, redis_server_major_version
from tests.workers import start_fake_worker, stop, wait_for, workers_live

pytestmark = pytest.mark.slow

GOOD = {"prompt_token_ids": [5, 6, 7], "max_tokens": 4}
ATTACK = {"prompt_token_ids": [66, 66, 66], "max_tokens": 6}  # the text the attacker would like to see


def job_data(request: dict) -> str:
    return json.dumps([keys.JOB_FUNCTION, None, [], {"request": request}])


@pytest.fixture
def hostile(redis_url):
    """A connection as the documented producer ACL user."""
    if redis_server_major_version(find_redis_server()) < 7:
        # Read-only key patterns (%R~) in the producer's ACL arrived in Redis 7 (as in test_security).
        pytest.skip("the test Redis is older than Redis 7: install redis-server 7 (apt / brew) to run this test")
    admin = redis.Redis.from_url(redis_url)
    name, *rules = PRODUCER_ACL.split()
    password = next(rule for rule in rules if rule.startswith(">"))
    admin.execute_command("ACL", "SETUSER", name, "reset", *rules)
    port = admin.connection_pool.connection_kwargs["port"]
    conn = redis.Redis(host="127.0.0.1", port=port, username=name, password=password.removeprefix(">"))
    assert conn.ping()
    with pytest.raises(redis.exceptions.NoPermissionError):  # what the ACL means to hold
        conn.set(keys.result_key("anything"), "forged")
    yield conn
    conn.close()
    admin.execute_command("ACL", "DELUSER", name)


REWRITES = st.fixed_dictionaries({}, optional={
    "status": st.sampled_from(["queued", "started", "finished", "failed", "canceled", "stopped", "scheduled",
                               "deferred", "", "bogus"]),
    "data": st.sampled_from([job_data(ATTACK), job_data(GOOD), "garbage"]),
    "origin": st.sampled_from(["mlxq", "elsewhere"]),
    "result_ttl": st.sampled_from(["-1", "5", "86400"]),
    "retries_left": st.sampled_from(["0", "3"]),
})
# (LPUSH, a push to a queue's head, is refused by the producer ACL: tests/test_security.py.)
REPLAYS = st.tuples(REWRITES, st.sampled_from(["rpush", "twice", "delete-and-recreate"]))


def replay(conn: redis.Redis, job_id: str, fields: dict, how: str) -> None:
    key = f"rq:job:{job_id}"
    if how == "delete-and-recreate":
        conn.delete(key)
        conn.hset(key, mapping={"data": job_data(ATTACK), "status": "queued", "origin": "mlxq",
                                "created_at": "2026-11-30T00:00:00.000000Z", **fields})
    elif fields:
        conn.hset(key, mapping=fields)
    conn.rpush("rq:queue:mlxq", job_id)
    if how == "twice":
        conn.rpush("rq:queue:mlxq", job_id)


def test_a_hostile_producer_cannot_run_an_ended_job_again_or_replace_its_result(redis_url, hostile):
    conn = redis.Redis.from_url(redis_url)
    client = Client(redis_url)
    worker = start_fake_worker(redis_url, name="runs-once", step_delay_s=0.0)
    log = drain(worker)
    try:
        # Jobs that ended every way a job ends: finished, failed (refused), cancelled while queued.
        ended = [client.submit(GOOD) for _ in range(6)]
        queue = Queue("mlxq", connection=conn, serializer=JSON_SERIALIZER)
        ended.append(queue.enqueue(keys.JOB_FUNCTION, request={"prompt": "x", "max_tokens": 0}).id)  # refused
        client.wait_many(ended, timeout=60)
        ended.append(client.submit({**GOOD, "max_tokens": 400}, job_id=f"cancel-{uuid.uuid4()}"))
        client.cancel(ended[-1])
        wait_for(lambda: conn.exists(keys.result_key(ended[-1])), timeout=30, what="the cancelled job's result")
        before = {job_id: conn.get(keys.result_key(job_id)) for job_id in ended}
        assert {json.loads(raw)["status"] for raw in before.values()} == {"finished", "failed", "cancelled"}
        # A hash whose status says it ended, with no result key: not run; given a result that says why.
        plant(conn, "said-finished", good_fields(status="finished"))
        plant(conn, "said-canceled", good_fields(status="canceled"))
        replays: list[tuple[str, dict, str]] = []

        @settings(max_examples=int(os.environ.get("MLXQ_FUZZ_EXAMPLES", "60")), deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
        @given(st.sampled_from(ended), REPLAYS)
        def attack(job_id, entry):
            fields, how = entry
            replay(hostile, job_id, fields, how)
            replays.append((job_id, fields, how))

        attack()
        good = [client.submit(GOOD) for _ in range(8)]
        assert all(r.status == "finished" for r in client.wait_many(good, timeout=60).values())
        wait_for(lambda: leftovers(conn, ["mlxq"]) == {}, timeout=60, what="every replayed id off the queue")
        wait_for(lambda: conn.exists(keys.result_key("said-finished"), keys.result_key("said-canceled")) == 2,
                 timeout=30, what="results for the planted ended hashes")
        time.sleep(1)  # anything run by mistake would have written by now
        assert worker.poll() is None, "the worker died"
    finally:
        stop(worker)
    out = "".join(log)
    assert worker.returncode == 0, out[-3000:]
    for job_id, raw in before.items():
        assert conn.get(keys.result_key(job_id)) == raw, (job_id, [r for r in replays if r[0] == job_id])
    said_finished = json.loads(conn.get(keys.result_key("said-finished")))
    assert said_finished["status"] == "failed" and "has ended already" in said_finished["error"]["message"]
    assert json.loads(conn.get(keys.result_key("said-canceled")))["status"] == "cancelled"
    assert "Traceback" not in out, out[-3000:]
    print(f"{len(replays)} replays of {len(ended)} ended jobs; every result unchanged")


@pytest.mark.parametrize("retried", [False, True])
def test_a_worker_given_up_for_dead_does_not_replace_the_result_written_after_it(redis_url, retried):
    """Frozen (SIGSTOP) past its heartbeat: another worker's sweep fails the job (or re-queues it, and
    runs it: `retried`). Thawed, the first worker finishes its run; the first result stays."""
    conn = redis.Redis.from_url(redis_url)
    client = Client(redis_url)
    frozen = start_fake_worker(redis_url, name="frozen", step_delay_s=0.05)
    frozen_log = drain(frozen)
    sweeper = None
    try:
        workers_live(conn, 1, timeout=30)
        queue = Queue("mlxq", connection=conn, serializer=JSON_SERIALIZER)
        job_id = queue.enqueue(keys.JOB_FUNCTION, request={**GOOD, "max_tokens": 120, "ignore_eos": True},
                               retry=Retry(max=1) if retried else None).id
        wait_for(lambda: client.status(job_id) == "started", timeout=30, what="the job to start")
        os.kill(frozen.pid, signal.SIGSTOP)
        sweeper = start_fake_worker(redis_url, name="sweeper", step_delay_s=0.0)
        wait_for(lambda: conn.exists(keys.result_key(job_id)), timeout=60, what="the sweep's (or the rerun's) result")
        first = conn.get(keys.result_key(job_id))
        os.kill(frozen.pid, signal.SIGCONT)
        dropped = ("wrote its result first", "dropped without writing")  # found at its write, or before it
        wait_for(lambda: any(any(d in line for d in dropped) for line in frozen_log)
                 or conn.get(keys.result_key(job_id)) != first, timeout=60, what="the thawed worker to finish its run")
        assert conn.get(keys.result_key(job_id)) == first
        result = json.loads(first)
        if retried:
            assert result["status"] == "finished" and result["worker"] == "sweeper", result
        else:
            assert result["status"] == "failed" and result["error"]["type"] == "AbandonedJobError", result
        after = client.wait(client.submit(GOOD), timeout=60)  # both go on working
        assert after.status == "finished"
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
        out = stop(frozen)
        sweeper_out = stop(sweeper) if sweeper is not None else ""
    assert frozen.returncode == 0, "".join(frozen_log)[-3000:] + out
    assert sweeper is None or sweeper.returncode == 0, sweeper_out[-3000:]


def test_an_id_pushed_again_while_its_job_runs_here_is_not_started_twice_and_costs_no_slot(redis_url, hostile):
    """A producer pushes a running job's id onto its queue again, ten times over, and once an id twice
    in a row. The worker started such an id a second time beside the first: both runs shared one entry
    of its bookkeeping, and each left a slot taken for good, until the worker (4 slots here) took no
    job at all. Now the copy leaves the queue without running, the job's first result stays, and the
    worker still runs 4 jobs at once."""
    conn = redis.Redis.from_url(redis_url)
    client = Client(redis_url)
    worker = start_fake_worker(redis_url, "--max-num-seqs", "4", name="once-each", step_delay_s=0.02)
    log = drain(worker)
    long = {**GOOD, "max_tokens": 40, "ignore_eos": True}
    try:
        for round_ in range(10):
            job_id = client.submit(long)
            wait_for(lambda: client.status(job_id) == "started", timeout=30, what="the job to start")
            hostile.rpush("rq:queue:mlxq", job_id)
            if round_ == 0:
                hostile.rpush("rq:queue:mlxq", job_id)
            result = client.wait(job_id, timeout=30)
            assert result.status == "finished" and len(result.choices[0].token_ids) == 40, result
            wait_for(lambda: leftovers(conn, ["mlxq"]) == {}, timeout=30, what="the copies off the queue")
        time.sleep(0.5)
        at_once = client.wait_many(client.submit_many([long] * 4), timeout=60).values()
        assert all(r.status == "finished" for r in at_once)
        assert max(r.timings.started_at for r in at_once) < min(r.timings.finished_at for r in at_once), [
            (r.timings.started_at, r.timings.finished_at) for r in at_once]  # all four ran together
        assert worker.poll() is None, "the worker died"
    finally:
        stop(worker)
    out = "".join(log)
    assert worker.returncode == 0, out[-3000:]
    assert "had a result already" not in out and "of dead workers" not in out, out[-3000:]  # no second run
    assert out.count("came off a queue again while it runs here") == 11, out[-3000:]


def test_a_job_sent_back_by_a_sweep_while_it_runs_here_and_taken_again_here_is_recorded_as_running(redis_url):
    """A sweep sends a job back to its queue once its run's records are gone (lost in a failover, or
    expired while its worker was cut off); the worker still running it takes that copy. It dropped
    the copy and left the run unrecorded: a worker cut off from Redis since the job started then took
    its own run for another worker's and dropped it unwritten, and the job was lost (seen in the
    Sentinel failover test). The run is recorded as running again, and ends once."""
    conn = redis.Redis.from_url(redis_url)
    client = Client(redis_url)
    worker = start_fake_worker(redis_url, name="rerecord", step_delay_s=0.05)
    log = drain(worker)
    try:
        job_id = client.submit({**GOOD, "max_tokens": 80, "ignore_eos": True})
        wait_for(lambda: client.status(job_id) == "started", timeout=30, what="the job to start")
        # What a sweep does with a job whose run's records are gone: out of the started registry, queued again.
        members = [m for m in conn.zrange("rq:wip:mlxq", 0, -1) if m.decode().startswith(job_id)]
        assert members, conn.zrange("rq:wip:mlxq", 0, -1)
        with conn.pipeline() as pipe:
            pipe.zrem("rq:wip:mlxq", *members)
            pipe.hset(f"rq:job:{job_id}", "status", "queued")
            pipe.rpush("rq:queue:mlxq", job_id)
            pipe.execute()
        wait_for(lambda: any("came off a queue again" in line for line in log), timeout=30, what="the copy taken")
        assert client.status(job_id) in ("started", "finished"), "".join(log)[-3000:]
        if client.status(job_id) == "started":
            assert [m for m in conn.zrange("rq:wip:mlxq", 0, -1) if m.decode().startswith(job_id)], "".join(log)[-3000:]
        result = client.wait(job_id, timeout=60)
        assert result.status == "finished" and len(result.choices[0].token_ids) == 80, result
        # (The result key is written before the job is ended in RQ's terms, in a call of its own.)
        wait_for(lambda: conn.hget(f"rq:job:{job_id}", "status") == b"finished", timeout=30,
                 what="the job finished in RQ's terms")
        assert conn.xlen(f"rq:results:{job_id}") == 1, "".join(log)[-3000:]  # ended once
    finally:
        stop(worker)
    out = "".join(log)
    assert worker.returncode == 0, out[-3000:]


def test_a_result_write_its_replicas_did_not_confirm_is_tried_again_as_its_own():
    """With durable results a result key is written on the primary before WAIT finds too few replicas;
    the bookkeeping thread writes it again until one confirms. That retry found the key there and took
    it for another run's: the job was never ended in RQ (its hash stayed `started`, the worker logged
    that another run wrote first). The write recognises its own bytes and the job ends once, finished."""
    with RedisServer() as primary:
        conn = redis.Redis(port=primary.port)
        client = Client(primary.url)
        env = {"MLXQ_DURABLE_RESULTS": "1", "MLXQ_DURABLE_TIMEOUT_MS": "100"}
        worker = start_fake_worker(primary.url, name="unconfirmed", env=env)
        log = drain(worker)
        try:
            job_id = client.submit({**GOOD, "max_tokens": 10, "ignore_eos": True})
            wait_for(lambda: sum("NotReplicated" in line for line in log) >= 2, timeout=30,
                     what="WAIT to fall short twice")
            assert conn.exists(keys.result_key(job_id)) and conn.hget(f"rq:job:{job_id}", "status") == b"started"
            with RedisServer(extra_args=["--replicaof", "127.0.0.1", str(primary.port)]):
                wait_for(lambda: conn.hget(f"rq:job:{job_id}", "status") == b"finished", timeout=60,
                         what="the job finished in RQ's terms")
                result = client.wait(job_id, timeout=10)
                assert result.status == "finished" and len(result.choices[0].token_ids) == 10, result
        finally:
            stop(worker)
            client.close()
            conn.close()
    out = "".join(log)
    assert worker.returncode == 0, out[-3000:]
    assert "another run of it wrote its result first" not in out, out[-3000:]
