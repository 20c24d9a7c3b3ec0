"""What the operator is told agrees with what happened: a cancelled job is not a failure in `mlxq stats`,
the dashboard's snapshot, `/metrics` or `mlxq info`; the worker logs every failure and cancellation;
a queue where jobs wait with no live worker is flagged, and an empty one nobody serves leaves the views;
a worker without a name gets a readable one."""

from __future__ import annotations

import io
import json
import re
import socket
import subprocess
import sys

import httpx
import pytest
import redis
from rich.console import Console

from mlxq.stats_command import render
from producer import Client
from producer.fleet_stats import read_snapshot
from tests.gateway import running_gateway
from tests.test_fleet_metrics import samples, value
from tests.workers import start_fake_worker, stop, wait_for

pytestmark = pytest.mark.slow


def mlxq_info(url: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "mlxq", "info", "--json", "--url", url], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return json.loads(out)


def shown(snapshot) -> str:
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(render(snapshot))
    return console.file.getvalue()


def test_cancelled_is_not_failed_anywhere_and_every_end_is_logged(redis_url):
    conn = redis.Redis.from_url(redis_url)
    client = Client(redis_url)
    worker = start_fake_worker(redis_url, "--alias", "m", name="", step_delay_s=0.02)
    out = ""
    try:
        wait_for(lambda: len(read_snapshot(conn).workers) == 1, timeout=60, what="a live worker")
        name = read_snapshot(conn).workers[0].name
        assert re.fullmatch(re.escape(socket.gethostname().split(".")[0]) + r"\.[0-9a-f]{6}", name), name
        ok = client.submit({"model": "m", "prompt_token_ids": [5, 6], "max_tokens": 4})
        bad = client.submit({"model": "m", "prompt_token_ids": [5, 300], "max_tokens": 4})
        long = client.submit({"model": "m", "prompt_token_ids": [9], "max_tokens": 2000, "ignore_eos": True})
        wait_for(lambda: client.status(long) == "started", what="the long job running")
        assert client.cancel(long)
        results = client.wait_many([ok, bad, long], timeout=60)
        assert [results[j].status for j in (ok, bad, long)] == ["finished", "failed", "cancelled"]
        wait_for(lambda: read_snapshot(conn).workers[0].jobs_cancelled == 1, timeout=10, what="the worker's tally")
        snapshot = read_snapshot(conn)
        (me,) = snapshot.workers
        assert (me.jobs_finished, me.failures, me.jobs_cancelled) == (1, {"InvalidRequest": 1}, 1)
        assert snapshot.failures == {"InvalidRequest": 1} and snapshot.cancelled == 1
        queue = {q.name: q for q in snapshot.queues}["mlxq:m"]
        assert queue.failed == 1  # the cancelled job is not in the failed registry
        info = mlxq_info(redis_url)
        assert info["queues"]["mlxq:m"]["failed"] == 1 and info["queues"]["mlxq:m"]["canceled"] == 1
        assert [w["failed_jobs"] for w in info["workers"]] == [1]
        with running_gateway(redis_url) as base:
            root = base.removesuffix("/v1")
            scraped = samples(httpx.get(f"{root}/metrics", timeout=10).text)
            dashboard = httpx.get(f"{root}/dashboard/data", timeout=10)
        labels = {"worker": name, "model_name": "m"}
        assert value(scraped, "mlxq:fleet_jobs_cancelled_total", **labels) == 1
        assert value(scraped, "mlxq:fleet_jobs_failed_total", **labels, error_type="InvalidRequest") == 1
        assert value(scraped, "mlxq:queue_jobs_failed", queue="mlxq:m") == 1
        assert dashboard.status_code == 200  # the page's own data: the same snapshot
        data = dashboard.json()["snapshot"]
        assert data["cancelled"] == 1 and data["failures"] == {"InvalidRequest": 1}
    finally:
        out = stop(worker)
        client.close()
    assert re.search(rf"job {bad} \(worker\.tasks\.generate\) failed: InvalidRequest: ", out), out
    assert re.search(rf"job {long} \(worker\.tasks\.generate\) cancelled after \d+ token", out), out


def test_a_queue_with_waiting_jobs_and_no_worker_is_flagged_and_an_empty_unserved_one_leaves(redis_url):
    conn = redis.Redis.from_url(redis_url)
    client = Client(redis_url)
    job = client.submit({"model": "gone", "prompt_token_ids": [1], "max_tokens": 2})
    snapshot = read_snapshot(conn)
    assert snapshot.unserved == ["mlxq:gone"]
    text = shown(snapshot)
    assert "NONE LIVE" in text and "jobs wait with no live worker on: mlxq:gone" in text
    with running_gateway(redis_url) as base:
        scraped = samples(httpx.get(f"{base.removesuffix('/v1')}/metrics", timeout=10).text)
    assert value(scraped, "mlxq:queue_unserved", queue="mlxq:gone") == 1
    client.cancel(job)
    assert "mlxq:gone" not in {q.name for q in read_snapshot(conn).queues}  # empty, unserved: out of the views
    assert "mlxq:gone" in {q.name for q in read_snapshot(conn, ("mlxq:gone",)).queues}  # unless asked for
    client.close()
