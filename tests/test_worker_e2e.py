"""The whole pipeline on real parts: producer -> redis-server -> worker process -> result keys."""

from __future__ import annotations

import json
import os
import time

import pytest
import redis
from rq import Callback, Queue
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry, FinishedJobRegistry
from rq.serializers import JSONSerializer

from producer import Client
from schemas import GenerationResult, keys
from tests.workers import rq_ends_as, run_rq_worker, start_worker, started_registry_empty, stop

pytestmark = pytest.mark.slow


def wait_status(client: Client, job_id: str, status: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while client.status(job_id) != status:
        assert time.monotonic() < deadline, f"{job_id} never reached {status}"
        time.sleep(0.02)


def test_greedy_parity_usage_and_rq_bookkeeping_with_mid_decode_arrivals(redis_url, tiny_model_dir, reference):
    proc = start_worker(redis_url, tiny_model_dir, "--max-num-seqs", "8", name="parity")
    client = Client(redis_url)
    try:
        def request(i: int, length: int, max_tokens: int, ignore_eos: bool) -> dict:
            return {"prompt_token_ids": [(i * 41 + k * 7) % 500 + 3 for k in range(length)], "max_tokens": max_tokens,
                    "temperature": 0, "logprobs": True, "ignore_eos": ignore_eos}

        long_requests = [request(i, 10 + i, 400, True) for i in range(3)]
        first = client.submit_many(long_requests)
        wait_status(client, first[0], "started", timeout=120)
        short_requests = [request(10 + i, 1 + 5 * i, 3 + 4 * i, i % 2 == 0) for i in range(6)]
        later = [client.submit(r) for r in short_requests]
        results = client.wait_many(first + later, timeout=300)
    finally:
        out = stop(proc)
    assert proc.returncode == 0, out

    for job_id, req in zip(first + later, long_requests + short_requests):
        result = results[job_id]
        assert result.status == "finished", result.error
        tokens, logprobs = reference(req["prompt_token_ids"], req["max_tokens"], req["ignore_eos"])
        choice = result.choices[0]
        assert choice.token_ids == tokens
        assert choice.logprobs == pytest.approx(logprobs, abs=1e-3)
        assert result.usage.prompt_tokens == len(req["prompt_token_ids"])
        assert result.usage.completion_tokens == len(tokens) == len(choice.token_ids)
        assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens
        assert result.worker == "parity"
        t = result.timings
        assert t.queue_s >= 0 and t.ttft_s >= 0 and t.generation_s >= t.ttft_s

    # The short jobs ran while the long ones were decoding: they joined the running batch.
    long_end = min(results[j].timings.finished_at for j in first)
    assert all(results[j].timings.started_at < long_end for j in later)
    assert all(results[j].timings.finished_at < long_end for j in later)

    conn = redis.Redis.from_url(redis_url)
    queue = Queue("mlxq", connection=conn, serializer=JSONSerializer)
    assert started_registry_empty(redis_url)
    assert set(FinishedJobRegistry(queue=queue).get_job_ids()) == set(first + later)
    for job_id in first + later:
        job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
        assert job.get_status() == JobStatus.FINISHED
        assert job.return_value() == json.loads(conn.get(keys.result_key(job_id)))
        assert 0 < conn.ttl(keys.result_key(job_id)) <= keys.DEFAULT_RESULT_TTL


class Boom:
    """Unpickling this would create a file: the proof that nothing was unpickled."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_bad_inputs_fail_clearly_and_good_neighbours_finish(redis_url, tiny_model_dir, tmp_path, reference):
    conn = redis.Redis.from_url(redis_url)
    queue = Queue("mlxq", connection=conn, serializer=JSONSerializer)
    client = Client(redis_url)
    good_request = {"prompt_token_ids": [5, 6, 7], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    good = [client.submit(good_request) for _ in range(2)]
    marker = tmp_path / "unpickled"
    bad = {
        "schema": (queue.enqueue(keys.JOB_FUNCTION, request={"prompt": "x", "max_tokens": -1}), "max_tokens"),
        "unknown-field": (queue.enqueue(keys.JOB_FUNCTION, request={"prompt": "x", "tempature": 1}), "tempature"),
        "not-object": (queue.enqueue(keys.JOB_FUNCTION, request="just a string"), "request"),
        "positional": (queue.enqueue(keys.JOB_FUNCTION, {"prompt": "x"}), "request"),
        "off-allowlist": (queue.enqueue("os.system", "touch /tmp/mlxq-pwned"), "allowlist"),
        "pickled": (Queue("mlxq", connection=conn).enqueue(print, Boom(str(marker))), "JSON"),
        "long-prompt": (queue.enqueue(keys.JOB_FUNCTION, request={"prompt_token_ids": [1] * 65}), "prompt"),
        "vocab": (queue.enqueue(keys.JOB_FUNCTION, request={"prompt_token_ids": [1, 512]}), "prompt_token_ids"),
        "model": (queue.enqueue(keys.JOB_FUNCTION, request={"prompt": "x", "model": "gpt-9"}), "model"),
        "callback": (queue.enqueue(keys.JOB_FUNCTION, request={"prompt": "x"}, on_success=Callback("os.getcwd")), "callback"),
    }
    good.append(client.submit(good_request))
    proc = start_worker(redis_url, tiny_model_dir, "--max-prompt-tokens", "64", name="bad-inputs")
    try:
        results = client.wait_many(good + [job.id for job, _ in bad.values()], timeout=300)
        assert proc.poll() is None, "the worker died"
        late = client.wait(client.submit(good_request), timeout=120)  # still serving afterwards
    finally:
        out = stop(proc)
    assert proc.returncode == 0, out
    assert not marker.exists() and not os.path.exists("/tmp/mlxq-pwned")

    tokens, _ = reference(good_request["prompt_token_ids"], good_request["max_tokens"], True)
    for job_id in good:
        assert results[job_id].status == "finished" and results[job_id].choices[0].token_ids == tokens
    assert late.choices[0].token_ids == tokens
    assert started_registry_empty(redis_url)
    failed_registry = set(FailedJobRegistry(queue=queue).get_job_ids())
    for name, (job, needle) in bad.items():
        result = results[job.id]
        assert result.status == "failed", name
        assert needle in result.error.message, (name, result.error.message)
        assert result.choices == []
        assert job.id in failed_registry, name
        assert Job.fetch(job.id, connection=conn, serializer=JSONSerializer).get_status() == JobStatus.FAILED


def test_default_queues_follow_the_model_alias(redis_url, tiny_model_dir):
    client = Client(redis_url)
    routed = client.submit({"prompt": "hi", "model": "tiny", "max_tokens": 3})
    assert Job.fetch(routed, connection=redis.Redis.from_url(redis_url), serializer=JSONSerializer).origin == "mlxq:tiny"
    plain = client.submit({"prompt": "hi", "max_tokens": 3})
    proc = start_worker(redis_url, tiny_model_dir, "--burst", name="routing")
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    assert client.result(routed).status == "finished" and client.result(routed).model == "tiny"
    assert client.result(plain).status == "finished"


def test_plain_rq_worker_command_runs_the_batch_worker(redis_url, tiny_model_dir, reference):
    client = Client(redis_url)
    request = {"prompt_token_ids": [9, 8, 7, 6], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    ids = client.submit_many([request] * 4)
    done = run_rq_worker(redis_url, "worker.BatchWorker", ["mlxq"], {"MLXQ_MODEL": tiny_model_dir})
    assert done.returncode == 0, done.stderr
    tokens, _ = reference(request["prompt_token_ids"], 12, True)
    for job_id in ids:
        result = client.result(job_id)
        assert result.status == "finished" and result.choices[0].token_ids == tokens


def test_generate_runs_one_at_a_time_under_a_stock_simple_worker(redis_url, tiny_model_dir, reference):
    client = Client(redis_url)
    requests = [
        {"prompt_token_ids": [3, 4, 5], "max_tokens": 7, "temperature": 0, "ignore_eos": True, "logprobs": True},
        {"prompt": "hello", "max_tokens": 5, "temperature": 0},
        {"prompt": "x", "max_tokens": 0},
    ]
    good = client.submit_many(requests[:2])
    conn = redis.Redis.from_url(redis_url)
    # The producer refuses max_tokens=0: push it raw, as a client in another language could.
    bad_job = Queue("mlxq", connection=conn, serializer=JSONSerializer).enqueue(keys.JOB_FUNCTION, request=requests[2])
    done = run_rq_worker(redis_url, "rq.SimpleWorker", ["mlxq"], {"MLXQ_MODEL": tiny_model_dir})
    assert done.returncode == 0, done.stderr
    first = client.result(good[0])
    tokens, logprobs = reference([3, 4, 5], 7, True)
    assert first.status == "finished" and first.choices[0].token_ids == tokens
    assert first.choices[0].logprobs == pytest.approx(logprobs, abs=1e-3)
    assert client.result(good[1]).status == "finished"
    failed = client.result(bad_job.id)
    assert failed.status == "failed" and "max_tokens" in failed.error.message
    assert rq_ends_as(redis_url, bad_job.id, JobStatus.FAILED)
    assert isinstance(first, GenerationResult)


def test_seeded_request_is_identical_across_workers_and_restarts(redis_url, tiny_model_dir):
    """The same seeded request, on two worker processes one after the other, alone and in a crowd."""
    client = Client(redis_url)
    seeded = {"prompt": "The queue said", "max_tokens": 20, "temperature": 1.2, "top_k": 40, "seed": 77,
              "ignore_eos": True, "n": 2}
    outputs = []
    for run, crowd in enumerate([0, 12]):
        strangers = [{"prompt_token_ids": [i + 3, i + 9], "max_tokens": 15, "temperature": 0.9, "ignore_eos": True}
                     for i in range(crowd)]
        ids = client.submit_many(strangers[: crowd // 2] + [seeded] + strangers[crowd // 2 :])
        proc = start_worker(redis_url, tiny_model_dir, "--burst", name=f"seeded-{run}")
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, out
        result = client.result(ids[crowd // 2])
        assert result.status == "finished"
        outputs.append([c.token_ids for c in result.choices])
    assert outputs[0] == outputs[1]
    assert outputs[0][0] != outputs[0][1]  # the n choices are distinct samples
