"""A gateway told to wait for replicas (MLXQ_API_DURABLE_REPLICAS) answers a job only once a replica
has it: what a failover of the primary cannot lose. Short of that it answers 503 `not_durable` naming the
job: kept when submitted asynchronously (it runs, and can be looked up), cancelled when the caller
waits on the answer (nobody would read it). On a real primary, a real replica and a real worker."""

from __future__ import annotations

import re

import httpx
import openai
import pytest
import redis

from mlxq.redis_server import RedisServer
from tests.gateway import running_gateway, wait_live
from tests.workers import start_fake_worker, stop, wait_for

pytestmark = pytest.mark.slow

JOB = {"model": "fake", "prompt": "x", "max_tokens": 3}


def named_job(reply: httpx.Response | openai.APIStatusError) -> str:
    body = reply.json() if isinstance(reply, httpx.Response) else reply.body
    error = body["error"] if "error" in body else body
    assert error["code"] == "not_durable", body
    found = re.search(r"The job (\S+) was enqueued, but 0 of the 1 replica", error["message"])
    assert found, error["message"]
    return found.group(1)


def test_a_durable_gateway_answers_a_job_once_a_replica_has_it_and_names_one_that_none_confirmed() -> None:
    with RedisServer() as primary:
        conn = redis.Redis(port=primary.port)
        worker = start_fake_worker(primary.url, "--model", "fake", name="durable", step_delay_s=0.01)
        try:
            wait_live(conn, "durable")
            # The default wait: a replica under CPU load once took longer than 100 ms to confirm.
            with running_gateway(primary.url, durable_replicas=1, durable_timeout_ms=2000) as base, \
                    httpx.Client(base_url=base, timeout=30) as http:
                reply = http.post("/jobs", json=JOB)
                assert reply.status_code == 503
                kept = named_job(reply)  # enqueued all the same: it runs, and can be looked up
                wait_for(lambda: http.get(f"/jobs/{kept}").json()["status"] == "finished", what="the kept job")

                chat = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
                with pytest.raises(openai.APIStatusError) as caught:
                    chat.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=1000)  # ~10 s: still running when the cancel comes
                assert caught.value.status_code == 503
                waited = named_job(caught.value)  # nobody waits on it any more: cancelled
                wait_for(lambda: http.get(f"/jobs/{waited}").json()["status"] == "cancelled",
                         what="the cancelled job")

                with RedisServer(extra_args=["--replicaof", "127.0.0.1", str(primary.port)]) as replica:
                    replica_conn = redis.Redis(port=replica.port)
                    wait_for(lambda: replica_conn.info("replication")["master_link_status"] == "up",
                             what="the replica's first sync")
                    reply = http.post("/jobs", json=JOB)
                    assert reply.status_code == 200, reply.text
                    job = reply.json()["id"]
                    assert replica_conn.exists(f"rq:job:{job}")  # there as the answer came
                    answer = chat.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}],
                                                          max_tokens=3)
                    assert answer.choices[0].finish_reason == "length"
                    replica_conn.close()
        finally:
            stop(worker)
            conn.close()
