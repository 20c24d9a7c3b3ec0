"""RQ's own tools on a live mlxq fleet: `rq info` reads mlxq's workers; its cleanup pickles JSON jobs'
meta whatever `--serializer` says (why `mlxq info --cleanup` exists); rq-dashboard, configured as
docker-compose.yml runs it, renders a JSON job's page (in headless Chromium)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import redis

from mlxq.redis_server import free_port
from producer import Client
from schemas import keys
from tests.browser import chromium_page
from tests.gateway import wait_live
from tests.workers import BIN, start_fake_worker, stop, wait_for

pytestmark = pytest.mark.slow


def rq(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "rq"), *args], capture_output=True, text=True, timeout=60)


def test_rq_info_reads_a_live_mlxq_fleet(redis_url):
    conn = redis.Redis.from_url(redis_url)
    workers = [start_fake_worker(redis_url, name=name, env={"MLXQ_ALIAS": "alpha"}) for name in ("rq-a", "rq-b")]
    client = Client(redis_url)
    try:
        for name in ("rq-a", "rq-b"):
            wait_live(conn, name)
        client.wait_many([client.submit({"model": "alpha", "prompt_token_ids": [5], "max_tokens": 3})
                          for _ in range(4)], timeout=60)
        plain = rq("info", "-u", redis_url)
        json_serializer = rq("info", "-u", redis_url, "-S", "rq.serializers.JSONSerializer")
        by_queue = rq("info", "-u", redis_url, "--by-queue")
    finally:
        client.close()
        outs = [stop(w) for w in workers]
    assert all(w.returncode == 0 for w in workers), outs
    for done in (plain, json_serializer, by_queue):
        assert done.returncode == 0, done.stderr
        assert "rq-a" in done.stdout and "rq-b" in done.stdout and "2 workers" in done.stdout, done.stdout
    assert "mlxq:alpha" in plain.stdout and "4 finished" in plain.stdout


def abandoned_json_job(conn: redis.Redis, client: Client) -> str:
    """A JSON job with a retry left, in the started registry of a worker that died (expired score)."""
    job_id = client.submit({"prompt_token_ids": [5], "max_tokens": 2}, queue="mlxq")
    conn.lrem("rq:queue:mlxq", 0, job_id)
    conn.hset(f"rq:job:{job_id}", mapping={"status": "started", "meta": json.dumps({"tenant": "t1"}),
                                           "retries_left": 1, "retry_intervals": "[0]"})
    conn.zadd("rq:wip:mlxq", {f"{job_id}:dead-execution": time.time() - 100})
    return job_id


def test_rq_info_pickles_json_meta_even_with_the_json_serializer(redis_url):
    conn = redis.Redis.from_url(redis_url)
    client = Client(redis_url)
    damaged = []
    for serializer in ([], ["-S", "rq.serializers.JSONSerializer"]):
        job_id = abandoned_json_job(conn, client)
        assert rq("info", "-u", redis_url, *serializer).returncode == 0
        meta = conn.hget(f"rq:job:{job_id}", "meta")
        damaged.append(meta.startswith(b"\x80") and b"unserialized" in meta)  # a pickle of {'unserialized': ...}
    assert damaged == [True, True]
    # mlxq info --cleanup recovers the same job the JSON way and leaves its meta JSON.
    job_id = abandoned_json_job(conn, client)
    cleanup = subprocess.run([sys.executable, "-m", "mlxq", "info", "--cleanup", "--url", redis_url],
                             capture_output=True, text=True, timeout=60)
    client.close()
    assert cleanup.returncode == 0, cleanup.stderr
    assert job_id in cleanup.stdout
    assert json.loads(conn.hget(f"rq:job:{job_id}", "meta")) == {"tenant": "t1"}


def test_rq_dashboard_renders_a_json_jobs_page(redis_url, tmp_path):
    conn = redis.Redis.from_url(redis_url)
    worker = start_fake_worker(redis_url, name="rqd-worker", env={"MLXQ_ALIAS": "alpha"})
    client = Client(redis_url)
    port = free_port()
    # As docker-compose.yml configures it: RQ_DASHBOARD_* variables, the JSON serializer on.
    dashboard = subprocess.Popen([sys.executable, "-m", "rq_dashboard"], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True,
                                 env={**os.environ, "RQ_DASHBOARD_REDIS_URL": redis_url, "RQ_DASHBOARD_JSON": "true",
                                      "RQ_DASHBOARD_BIND": "127.0.0.1", "RQ_DASHBOARD_PORT": str(port)})
    try:
        wait_live(conn, "rqd-worker")
        job_id = client.submit({"model": "alpha", "prompt_token_ids": [5, 6], "max_tokens": 5,
                                "custom_id": "shown-in-rq-dashboard"})
        result = client.wait(job_id, timeout=60)
        wait_for(lambda: conn.hget(f"rq:job:{job_id}", "status") == b"finished", timeout=15, what="RQ's end")
        with chromium_page() as page:
            for _ in range(100):  # until the dashboard listens
                try:
                    page.goto(f"http://127.0.0.1:{port}/0/view/job/{job_id}")
                    break
                except Exception:  # playwright's net::ERR_CONNECTION_REFUSED
                    time.sleep(0.1)
            page.wait_for_function(f"() => document.getElementById('job-data').innerText.includes('{job_id}')",
                                   timeout=30_000)
            shown = page.inner_text("#job-data")
            page.screenshot(path=str(tmp_path / "rq-dashboard-job.png"), full_page=True)
            page.goto(f"http://127.0.0.1:{port}/0/view/queues")
            page.wait_for_function("() => document.body.innerText.includes('mlxq:alpha')", timeout=30_000)
    finally:
        client.close()
        dashboard.terminate()
        dashboard_log = dashboard.communicate(timeout=20)[0]
        out = stop(worker)
    assert worker.returncode == 0, out
    assert result.status == "finished"
    assert "worker.tasks.generate" in shown and "finished" in shown, shown
    assert "shown-in-rq-dashboard" in shown, shown  # the job's JSON result, decoded
    assert "Traceback" not in dashboard_log, dashboard_log
    assert conn.exists(keys.result_key(job_id))
