"""A declared model (MLXQ_API_MODELS) with no live worker: the gateway's asynchronous paths (`/v1/jobs`,
batches) take its jobs, which wait in their queue and run when a worker comes; the blocking paths
answer 503 at once; an undeclared, unknown model is 404."""

from __future__ import annotations

import io
import json
import time

import httpx
import openai
import pytest

from tests.gateway import running_gateway
from tests.workers import start_fake_worker, stop, wait_for

pytestmark = pytest.mark.slow

CHAT = {"model": "later", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_a_declared_model_waits_for_its_worker_on_the_asynchronous_paths(redis_url):
    with running_gateway(redis_url, models=("later",), batch_drive_interval_s=0.1) as base, \
            httpx.Client(base_url=base, timeout=30) as http:
        blocking = http.post("/chat/completions", json=CHAT)
        assert blocking.status_code == 503 and blocking.json()["error"]["code"] == "no_live_worker"
        unknown = http.post("/jobs", json={"model": "nobody", "prompt": "x", "max_tokens": 2})
        assert unknown.status_code == 404
        job = http.post("/jobs", json={"model": "later", "prompt": "hello", "max_tokens": 4})
        assert job.status_code == 200, job.text
        job_id = job.json()["id"]
        batch_client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
        line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": CHAT}
        upload = batch_client.files.create(file=("b.jsonl", io.BytesIO(json.dumps(line).encode() + b"\n"),
                                                 "application/jsonl"), purpose="batch")
        batch = batch_client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")
        time.sleep(1.5)
        assert http.get(f"/jobs/{job_id}").json()["status"] == "queued"
        assert batch_client.batches.retrieve(batch.id).status in ("validating", "in_progress")
        worker = start_fake_worker(redis_url, "--model", "later", name="arrives", step_delay_s=0.005)
        try:
            wait_for(lambda: http.get(f"/jobs/{job_id}").json()["status"] == "finished", timeout=60, interval=0.2,
                     what="the job to run once its worker came")
            wait_for(lambda: batch_client.batches.retrieve(batch.id).status == "completed", timeout=60, interval=0.2,
                     what="the batch to complete once its worker came")
        finally:
            out = stop(worker)
        done = batch_client.batches.retrieve(batch.id)
        assert done.request_counts.completed == 1, out
