"""Request bodies over the served model's limits (vocabulary, context, message counts, text), sent
raw past the producer's checks, to one real worker on the tiny model: each fails alone naming its
field and the limit; the good requests beside them finish exactly; sampling still works after."""

from __future__ import annotations

import json

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rq import Queue

from producer import Client, InvalidRequest
from schemas import keys
from schemas.serializer import JSON_SERIALIZER
from tests.workers import start_worker, stop

VOCAB = 512  # worker/tiny_model.py's "tiny" shape
CONTEXT = 8192
GOOD = {"prompt_token_ids": [5, 6, 7], "max_tokens": 12, "temperature": 0, "ignore_eos": True}


def raw_job(conn: redis.Redis, data: bytes) -> str:
    """A job whose data is written as is: JSON that no Python producer could send."""
    job_id = f"raw-{conn.incr('test:raw-ids')}"
    conn.hset(f"rq:job:{job_id}", mapping={"data": data, "status": "queued", "origin": "mlxq",
                                             "created_at": "2026-11-30T00:00:00.000000Z"})
    conn.rpush("rq:queue:mlxq", job_id)
    return job_id


@pytest.mark.slow
def test_requests_over_the_models_limits_fail_alone_and_sampling_survives(redis_url, tiny_model_dir, reference):
    conn = redis.Redis.from_url(redis_url)
    queue = Queue("mlxq", connection=conn, serializer=JSON_SERIALIZER)
    client = Client(redis_url)

    def unchecked(**request: object) -> str:  # past the producer: what another language could enqueue
        return queue.enqueue(keys.JOB_FUNCTION, request={"prompt_token_ids": [1, 2], "max_tokens": 4, **request}).id

    bad = {  # job id -> (field, limit named in the message)
        unchecked(logit_bias={str(VOCAB): 5.0}): ("logit_bias", f"[0, {VOCAB})"),
        unchecked(logit_bias={"3": 1.0, str(VOCAB + 300): 5.0}): ("logit_bias", f"[0, {VOCAB})"),
        unchecked(top_k=VOCAB, temperature=1.0): ("top_k", str(VOCAB)),
        unchecked(top_k=10**6, temperature=1.0): ("top_k", str(VOCAB)),
        unchecked(stop_token_ids=[VOCAB + 1]): ("stop_token_ids", f"[0, {VOCAB})"),
        unchecked(prompt_token_ids=[1, VOCAB]): ("prompt_token_ids", f"[0, {VOCAB})"),
        unchecked(prompt_token_ids=[1] * 5000, max_tokens=4000): ("max_tokens", str(CONTEXT)),
        unchecked(prompt_token_ids=None, messages=[{"role": "user", "content": "hi"}] * 100_000):
            ("messages", "2048"),
        unchecked(prompt_token_ids=None, prompt="x" * 1_000_001): ("prompt", "1000000"),
        unchecked(n=12): ("n", "MLXQ_MAX_NUM_SEQS"),
        raw_job(conn, b'["worker.tasks.generate", null, [], {"request": {"prompt": "a\\ud800b"}}]'):
            ("prompt", "surrogate"),
        raw_job(conn, json.dumps(["worker.tasks.generate", None, [],
                                  {"request": {"prompt": "x", "metadata": _nested(80)}}]).encode()):
            ("metadata", "64 levels"),
        raw_job(conn, b'["worker.tasks.generate", null, [], {"request": ' + b"[" * 50_000 + b"]" * 50_000 + b"}]"):
            ("job data", "nested too deeply"),
    }
    good = [client.submit(GOOD) for _ in range(3)]
    # Unseeded sampled rows after the bad top_k ones: an engine error once left MLX's generator broken.
    sampled = [client.submit({"prompt_token_ids": [4, 5], "max_tokens": 6, "temperature": 1.0}) for _ in range(4)]
    worker = start_worker(redis_url, tiny_model_dir, "--max-num-seqs", "8", name="limits")
    try:
        results = client.wait_many([*bad, *good, *sampled], timeout=180)
        assert worker.poll() is None, "the worker died"
    finally:
        out = stop(worker)
    assert worker.returncode == 0, out[-3000:]
    for job_id, (field, limit) in bad.items():
        error = results[job_id].error
        assert results[job_id].status == "failed" and error is not None, (job_id, results[job_id])
        assert error.message.startswith(field) or f" {field}" in error.message, (field, error.message)
        assert limit in error.message, (limit, error.message)
    tokens, _ = reference(GOOD["prompt_token_ids"], GOOD["max_tokens"], True)
    assert all(results[j].status == "finished" and results[j].choices[0].token_ids == tokens for j in good)
    assert all(results[j].status == "finished" for j in sampled), [results[j].error for j in sampled]


def _nested(depth: int) -> object:
    value: object = "leaf"
    for _ in range(depth):
        value = {"k": value}
    return value


def test_the_producer_refuses_the_same_bodies_before_enqueueing(redis_url):
    client = Client(redis_url)
    cases = {
        "messages": {"messages": [{"role": "user", "content": "hi"}] * 100_000},
        "prompt": {"prompt": "a\ud800"},
        "messages[0].content[0].text": {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
        "metadata": {"prompt": "x", "metadata": _nested(80)},
    }
    for field, request in cases.items():
        with pytest.raises(InvalidRequest) as caught:
            client.submit(request)
        assert caught.value.field == field, (field, str(caught.value))
    assert redis.Redis.from_url(redis_url).llen("rq:queue:mlxq") == 0


@pytest.mark.slow
def test_generated_token_ids_around_the_vocabulary_edge(redis_url, tiny_model_dir):
    """Each request either runs (every id inside the vocabulary) or fails naming its field."""
    conn = redis.Redis.from_url(redis_url)
    queue = Queue("mlxq", connection=conn, serializer=JSON_SERIALIZER)
    edge = st.integers(VOCAB - 3, VOCAB + 3) | st.integers(0, 10**9)
    requests = st.fixed_dictionaries({"prompt_token_ids": st.lists(st.integers(0, VOCAB + 2), min_size=1, max_size=4),
                                      "max_tokens": st.just(3)},
                                     optional={"logit_bias": st.dictionaries(edge.map(str), st.floats(-5, 5),
                                                                             max_size=3),
                                               "stop_token_ids": st.lists(edge, max_size=3),
                                               "top_k": edge, "temperature": st.just(1.0)})
    sent: list[tuple[str, dict]] = []

    @settings(max_examples=60, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(requests)
    def enqueue(request):
        sent.append((queue.enqueue(keys.JOB_FUNCTION, request=request).id, request))

    enqueue()
    worker = start_worker(redis_url, tiny_model_dir, "--max-num-seqs", "16", name="edge")
    try:
        results = Client(redis_url).wait_many([j for j, _ in sent], timeout=180)
        assert worker.poll() is None, "the worker died"
    finally:
        out = stop(worker)
    assert worker.returncode == 0, out[-3000:]
    for job_id, request in sent:
        named = [*request["prompt_token_ids"], *map(int, request.get("logit_bias", {})),
                 *request.get("stop_token_ids", [])]
        inside = all(t < VOCAB for t in named) and request.get("top_k", 0) < VOCAB
        result = results[job_id]
        assert (result.status == "finished") == inside, (request, result.error)
        if not inside:
            assert result.error.type == "InvalidRequest" and f"{VOCAB}" in result.error.message, result.error
