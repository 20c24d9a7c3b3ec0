"""Fuzzing the real worker: a thousand hostile jobs (hypothesis), each must end failed with a
clear error in its result key; the worker survives and its memory stays bounded."""

from __future__ import annotations

import json
import uuid

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rq import Queue
from rq.serializers import JSONSerializer

from producer import Client
from schemas import keys
from tests.workers import start_fake_worker, stop, wait_for

pytestmark = pytest.mark.slow

FIELDS = ["prompt", "messages", "prompt_token_ids", "model", "max_tokens", "temperature", "top_p", "top_k", "min_p",
          "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "seed", "stop",
          "stop_token_ids", "n", "logprobs", "top_logprobs", "return_prompt_token_ids", "stream", "ignore_eos",
          "custom_id", "metadata", "logprobs_mode", "tools", "tool_choice", "parallel_tool_calls", "tool_call_format",
          "chat_template_kwargs", "prompt_logprobs"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
base = st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=30)})


def with_field(field: str, values: st.SearchStrategy) -> st.SearchStrategy:
    return base.flatmap(lambda b: values.map(lambda v: {**b, field: v}))


bad_requests = st.one_of(
    # unknown fields
    base.flatmap(lambda b: st.text(min_size=1, max_size=12).filter(lambda k: k not in FIELDS)
                 .flatmap(lambda k: json_values.map(lambda v: {**b, k: v}))),
    # wrong types
    with_field("max_tokens", st.text() | st.floats(0.5, 9.5) | st.lists(st.integers())),
    with_field("temperature", st.text() | st.lists(st.floats())),
    with_field("logprobs", st.integers() | st.text(min_size=1)),
    with_field("stop", st.integers() | st.lists(st.integers(), min_size=1)),
    with_field("messages", st.text() | st.lists(st.integers(), min_size=1)),
    # out of range
    with_field("max_tokens", st.integers(max_value=0) | st.integers(min_value=4097)),
    with_field("temperature", st.floats(2.01, 1e6) | st.floats(-1e6, -0.01)),
    with_field("top_p", st.floats(1.01, 10) | st.floats(-10, 0)),
    with_field("n", st.integers(min_value=17) | st.integers(max_value=0)),
    with_field("top_logprobs", st.integers(min_value=21)),
    with_field("logit_bias", st.dictionaries(st.integers(0, 100).map(str), st.floats(100.5, 1e9), min_size=1)),
    with_field("stop", st.lists(st.text(min_size=1), min_size=5, max_size=8)),
    # agents' fields (schemas/agents.py): malformed tools, a choice without them, reserved template variables
    with_field("tools", st.text() | st.integers() | st.lists(json_values, min_size=1)),
    with_field("tool_choice", st.just("required") | st.text().filter(lambda t: t not in ("auto", "none", "required"))),
    with_field("chat_template_kwargs", st.dictionaries(st.sampled_from(["tokenize", "messages", "chat_template"]),
                                                       json_values, min_size=1)),
    with_field("prompt_logprobs", st.integers(min_value=21) | st.integers(max_value=-1)),
    # inputs: none, two, or ids the model does not have
    st.fixed_dictionaries({"max_tokens": st.integers(1, 10)}),
    base.flatmap(lambda b: st.lists(st.integers(0, 200), min_size=1).map(lambda ids: {**b, "prompt_token_ids": ids})),
    st.lists(st.integers(0, 300), min_size=1).filter(lambda ids: max(ids) >= 256)
    .map(lambda ids: {"prompt_token_ids": ids}),
    st.lists(st.integers(max_value=-1), min_size=1).map(lambda ids: {"prompt_token_ids": ids}),
    # not an object at all
    json_values.filter(lambda v: not isinstance(v, dict)),
)

# What a hostile client can put on the queue besides a bad request.
bad_jobs = st.one_of(
    bad_requests.map(lambda r: ("request", r)),
    st.sampled_from(["os.system", "builtins.eval", "subprocess.run", "worker.tasks._process_scheduler"])
    .map(lambda f: ("function", f)),
    json_values.map(lambda v: ("positional", v)),
    st.binary(min_size=1, max_size=64).map(lambda b: ("raw", b)),
)


def push(connection: redis.Redis, queue: Queue, kind: str, value) -> str:
    if kind == "request":
        return queue.enqueue(keys.JOB_FUNCTION, request=value).id
    if kind == "function":
        return queue.enqueue(value, "touch /tmp/mlxq-fuzz-pwned").id
    if kind == "positional":
        return queue.enqueue(keys.JOB_FUNCTION, value).id
    # raw bytes where the JSON job data should be: a client in another language gone wrong
    job_id = str(uuid.uuid4())
    connection.hset(f"rq:job:{job_id}", mapping={"data": value, "status": "queued", "origin": queue.name,
                                                  "created_at": "2026-11-30T00:00:00.000000Z"})
    connection.rpush(queue.key, job_id)
    connection.sadd("rq:queues", queue.key)
    return job_id


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def test_a_thousand_hostile_jobs_each_fail_clearly_and_the_worker_survives(redis_url):
    connection = redis.Redis.from_url(redis_url)
    queue = Queue("mlxq", connection=connection, serializer=JSONSerializer)
    pushed: list[tuple[str, str]] = []

    @settings(max_examples=1000, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(bad_jobs)
    def enqueue(job):
        kind, value = job
        pushed.append((kind, push(connection, queue, kind, value)))

    enqueue()
    assert len(pushed) >= 1000
    good = Client(redis_url).submit({"prompt_token_ids": [5, 6], "max_tokens": 4})
    worker = start_fake_worker(redis_url, name="fuzzed", step_delay_s=0.0)
    try:
        wait_for(lambda: connection.exists(keys.result_key(pushed[150][1])), timeout=120, what="first results")
        rss_early = rss_kb(worker.pid)
        wait_for(lambda: all(connection.exists(keys.result_key(j)) for _, j in pushed[-20:]), timeout=300,
                 what="the last results")
        rss_late = rss_kb(worker.pid)
        assert worker.poll() is None, "the worker died"
        late_good = Client(redis_url).wait(Client(redis_url).submit({"prompt_token_ids": [7], "max_tokens": 3}), 60)
    finally:
        out = stop(worker)
    assert late_good.status == "finished"
    assert Client(redis_url).result(good).status == "finished"
    kinds: dict[str, int] = {}
    for kind, job_id in pushed:
        raw = connection.get(keys.result_key(job_id))
        assert raw is not None, (kind, job_id)
        result = json.loads(raw)
        assert result["status"] == "failed", (kind, result)
        error = result["error"]
        assert error["type"] in {"InvalidRequest", "FunctionNotAllowed", "DeserializationError"}, error
        assert len(error["message"]) > 10
        kinds[error["type"]] = kinds.get(error["type"], 0) + 1
    print(f"{len(pushed)} hostile jobs: {kinds}; worker RSS {rss_early / 1024:.0f} -> {rss_late / 1024:.0f} MiB")
    assert rss_late - rss_early < 64 * 1024, out[-2000:]  # bounded: no per-job leak
