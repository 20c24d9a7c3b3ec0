"""The HTTP gateway, through the official `openai` client, against a real redis-server and a real
fake-engine worker process. Chat, completions, models, errors, auth, tenants, limits, disconnects, jobs.
Files and batches: tests/test_gateway_batches.py."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest
import redis

from mlxq.redis_server import RedisServer
from producer.api import keys as api_keys
from producer.api.auth import Tenant
from schemas import GenerationResult, keys
from tests.gateway import announce, key_entry, running_gateway, wait_live
from tests.workers import start_fake_worker, stop, wait_for

KEYS = {"acme": "sk-acme-test-1", "globex": "sk-globex-test-1"}
CHAT = [{"role": "user", "content": "Say something"}]


@dataclass
class Stack:
    url: str
    base: str
    conn: redis.Redis

    def client(self, tenant: str = "acme", **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base, api_key=KEYS[tenant], max_retries=0, **kwargs)

    def result(self, job_id: str) -> GenerationResult | None:
        raw = self.conn.get(keys.result_key(job_id))
        return GenerationResult.model_validate_json(raw) if raw else None


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with RedisServer() as server:
        conn = redis.Redis.from_url(server.url)
        worker = start_fake_worker(server.url, "--model", "fake", step_delay_s=0.005)
        try:
            wait_live(conn, "fake")
            entries = ",".join(key_entry(tenant, key) for tenant, key in KEYS.items())
            with running_gateway(server.url, api_keys=entries) as base:
                yield Stack(server.url, base, conn)
        finally:
            stop(worker)
            conn.close()


# ---------------------------------------------------------------- chat and completions


def test_models_come_from_live_workers(stack: Stack) -> None:
    assert [m.id for m in stack.client().models.list()] == ["fake"]
    other = start_fake_worker(stack.url, "--model", "other", name="other-worker")
    try:
        wait_for(lambda: [m.id for m in stack.client().models.list()] == ["fake", "other"], timeout=30,
                 what="the second worker's heartbeat")
        assert stack.client().chat.completions.create(model="other", messages=CHAT, max_tokens=2).choices
    finally:
        stop(other)  # a worker that stops withdraws its entry
    wait_for(lambda: [m.id for m in stack.client().models.list()] == ["fake"], timeout=10, what="withdrawal")
    # a model served lately without a live worker now: 503, not 404
    with pytest.raises(openai.InternalServerError) as info:
        stack.client().chat.completions.create(model="other", messages=CHAT, max_tokens=2)
    assert info.value.status_code == 503 and info.value.body["code"] == "no_live_worker"


def test_chat_blocking_and_streamed_give_the_same_answer(stack: Stack) -> None:
    client = stack.client()
    ask = dict(model="fake", messages=CHAT, max_tokens=9, temperature=0, n=2, seed=3, logprobs=True, top_logprobs=1,
               extra_body={"return_token_ids": True})
    blocking = client.chat.completions.create(**ask)
    assert [c.message.content for c in blocking.choices][0] and len(blocking.choices) == 2
    assert blocking.usage.completion_tokens == 18 and blocking.object == "chat.completion"
    first = blocking.choices[0]
    assert first.finish_reason == "length" and len(first.logprobs.content) == 9
    assert first.logprobs.content[0].top_logprobs[0].token == first.logprobs.content[0].token
    assert len(first.model_extra["token_ids"]) == 9 and blocking.model_extra["prompt_token_ids"]

    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    ids: dict[int, list[int]] = {0: [], 1: []}
    logprobs: dict[int, list[Any]] = {0: [], 1: []}
    finish = {}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            ids[choice.index] += choice.model_extra.get("token_ids", [])
            if choice.delta.content:  # each token chunk carries its own tokens' logprobs, in OpenAI's shape
                assert len(choice.logprobs.content) == len(choice.model_extra["token_ids"])
            logprobs[choice.index] += choice.logprobs.content if choice.logprobs else []
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert chunks[0].choices[0].delta.role == "assistant"
    assert texts == {c.index: c.message.content for c in blocking.choices}
    assert ids == {c.index: c.model_extra["token_ids"] for c in blocking.choices}
    assert logprobs == {c.index: c.logprobs.content for c in blocking.choices}
    assert finish == {0: "length", 1: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == blocking.usage.total_tokens
    assert chunks[-1].model_extra["prompt_token_ids"] == blocking.model_extra["prompt_token_ids"]


def test_completions_blocking_and_streamed(stack: Stack) -> None:
    client = stack.client()
    blocking = client.completions.create(model="fake", prompt=[5, 6, 7], max_tokens=6, logprobs=2, stop=None)
    assert blocking.object == "text_completion" and blocking.usage.prompt_tokens == 3
    assert len(blocking.choices[0].logprobs.tokens) == 6 and blocking.choices[0].logprobs.text_offset[0] == 0
    chunks = [c for c in client.completions.create(model="fake", prompt=[5, 6, 7], max_tokens=6, logprobs=2,
                                                    stream=True) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == blocking.choices[0].text
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for name, values in (chunk.choices[0].logprobs.model_dump() if chunk.choices[0].logprobs else {}).items():
            streamed[name] += values
    assert streamed == blocking.choices[0].logprobs.model_dump()
    text = client.completions.create(model="fake", prompt="hello", max_tokens=4).choices[0]
    assert text.finish_reason == "length" and len(text.text) == 4


def test_errors_in_openai_shape(stack: Stack) -> None:
    client = stack.client()
    for kwargs, param in (
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=2, extra_body={"tools_choice": "x"}), "tools_choice"),
        (dict(max_tokens=2, top_logprobs=3), "top_logprobs"),
        (dict(max_tokens=2, temperature=5), "temperature"),
        (dict(max_tokens=2, extra_body={"priority": "urgent"}), "priority"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="fake", messages=CHAT, **kwargs)
        assert info.value.body["param"] == param, (kwargs, info.value.body)
        assert info.value.body["type"] == "invalid_request_error" and param in info.value.body["message"]
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-model", messages=CHAT)
    assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"
    # a request the worker refuses (ids outside the fake engine's 256-token vocabulary) is a 400 too
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="fake", prompt=[5, 999], max_tokens=2)
    assert "prompt_token_ids" in refused.value.body["message"]


def test_auth(stack: Stack) -> None:
    for headers in ({}, {"Authorization": "Basic c2VjcmV0"}):
        with pytest.raises(openai.AuthenticationError) as info:
            openai.OpenAI(base_url=stack.base, api_key="wrong", max_retries=0, default_headers=headers).models.list()
        assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    assert stack.client("globex").models.list().data


# ---------------------------------------------------------------- jobs and tenants


def events(client: openai.OpenAI, job_id: str, last_event_id: str | None = None) -> list[tuple[str, str, Any]]:
    headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
    stream = client.get(f"/jobs/{job_id}/events", cast_to=object, stream=True, stream_cls=openai.Stream[object],
                        options={"headers": headers})
    return [(sse.id, sse.event, sse.json()) for sse in stream._iter_events()]


def test_jobs_endpoints(stack: Stack) -> None:
    client = stack.client()
    job = client.post("/jobs", cast_to=object, body={"prompt": "abc", "model": "fake", "max_tokens": 5, "stream": True})
    assert job["object"] == "mlxq.job" and job["status"] == "queued"
    # a gateway job may run as long as a request may wait, not RQ's default 180 s
    assert stack.conn.hget(f"rq:job:{job['id']}", "timeout") == b"3600"
    got = events(client, job["id"])
    assert [event for _, event, _ in got] == ["token"] * 5 + ["end"]
    assert got[-1][2] == {"event": "end", "status": "finished", "finish_reasons": ["length"]}
    resumed = events(client, job["id"], last_event_id=got[2][0])
    assert resumed == got[3:]
    read = client.get(f"/jobs/{job['id']}", cast_to=object)
    assert read["status"] == "finished" and read["result"]["choices"][0]["text"] == "".join(
        data["text"] for _, event, data in got if event == "token")
    cancelled = client.delete(f"/jobs/{job['id']}", cast_to=object)
    assert cancelled["cancelled"] is False  # it had ended
    with pytest.raises(openai.BadRequestError) as info:
        client.post("/jobs", cast_to=object, body={"prompt": "abc", "model": "fake", "max_tokens": -1})
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:  # a check of the whole request names its field too
        client.post("/jobs", cast_to=object, body={"prompt": "abc", "model": "fake", "guided_regex": "a",
                                                   "guided_grammar": 'start: "a"'})
    assert info.value.body["param"] == "guided_regex" and "at most one constraint" in info.value.body["message"]


def test_a_tenant_sees_only_its_own_jobs(stack: Stack) -> None:
    mine, theirs = stack.client("acme"), stack.client("globex")
    job = mine.post("/jobs", cast_to=object, body={"prompt": "x", "model": "fake", "max_tokens": 3000})
    for call in (lambda: theirs.get(f"/jobs/{job['id']}", cast_to=object),
                 lambda: theirs.delete(f"/jobs/{job['id']}", cast_to=object),
                 lambda: events(theirs, job["id"]),
                 lambda: theirs.get("/jobs/not-a-job", cast_to=object)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert mine.delete(f"/jobs/{job['id']}", cast_to=object)["cancelled"] is True
    wait_for(lambda: (stack.result(job["id"]) or GenerationResult(id="", status="failed")).status == "cancelled",
             timeout=10, what="the owner's cancel")


def test_disconnect_cancels_the_job(stack: Stack) -> None:
    before = set(stack.conn.keys("rq:job:*"))
    impatient = stack.client(timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(model="fake", messages=CHAT, max_tokens=4000)
    stream = stack.client().chat.completions.create(model="fake", messages=CHAT, max_tokens=4000, stream=True)
    assert next(iter(stream)).choices[0].delta.role == "assistant"
    streamed_job = stream.response.headers["x-mlxq-job-id"]
    stream.close()
    new = [k.decode().removeprefix("rq:job:") for k in set(stack.conn.keys("rq:job:*")) - before]
    assert streamed_job in new and len(new) == 2
    for job_id in new:
        wait_for(lambda: stack.result(job_id) is not None, timeout=15, what=f"job {job_id} to end")
        result = stack.result(job_id)
        assert result is not None and result.status == "cancelled"
        assert result.usage.completion_tokens < 4000


def test_limits_and_routing(stack: Stack, tmp_path: Any) -> None:
    """A second gateway on the same Redis with tight limits; "ghost" has a heartbeat but no worker, so its
    jobs stay queued."""
    announce(stack.conn, "ghost-worker", "ghost", queues=["mlxq:ghost", "mlxq:ghost@high", "mlxq"])
    with running_gateway(stack.url, api_keys=key_entry("acme", KEYS["acme"]), max_queue_depth=2,
                         tenant_max_in_flight=3, max_body_bytes=4096) as base:
        client = openai.OpenAI(base_url=base, api_key=KEYS["acme"], max_retries=0)
        for _ in range(2):
            client.post("/jobs", cast_to=object, body={"prompt": "x", "model": "ghost"})
        with pytest.raises(openai.RateLimitError) as deep:
            client.post("/jobs", cast_to=object, body={"prompt": "x", "model": "ghost"})
        assert deep.value.body["code"] == "queue_full"
        high = client.post("/jobs", cast_to=object, body={"prompt": "x", "model": "ghost"},
                           options={"params": {"priority": "high"}})
        assert stack.conn.lrange("rq:queue:mlxq:ghost@high", 0, -1) == [high["id"].encode()]
        with pytest.raises(openai.RateLimitError) as busy:
            client.post("/jobs", cast_to=object, body={"prompt": "x", "model": "ghost"}, options={"params": {"priority": "high"}})
        assert busy.value.body["code"] == "too_many_jobs_in_flight"
        # chat is admitted and enqueued in the same script: refused, it answers the same and enqueues nothing
        jobs_before = len(stack.conn.keys("rq:job:*"))
        with pytest.raises(openai.RateLimitError) as chat_deep:
            client.chat.completions.create(model="ghost", messages=CHAT, max_tokens=1)
        with pytest.raises(openai.RateLimitError) as chat_busy:
            client.chat.completions.create(model="ghost", messages=CHAT, max_tokens=1, extra_body={"priority": "high"})
        assert chat_deep.value.body == deep.value.body and chat_busy.value.body == busy.value.body
        assert chat_busy.value.response.headers["retry-after"] == "1"
        assert len(stack.conn.keys("rq:job:*")) == jobs_before
        with pytest.raises(openai.InternalServerError) as unheard:
            client.post("/jobs", cast_to=object, body={"prompt": "x", "model": "ghost"}, options={"params": {"priority": "low"}})
        assert unheard.value.status_code == 503
        with pytest.raises(openai.APIStatusError) as large:
            client.chat.completions.create(model="ghost", messages=[{"role": "user", "content": "x" * 5000}])
        assert large.value.status_code == 413 and large.value.body["code"] == "request_too_large"
        ids = [k.decode().removeprefix("rq:job:") for k in stack.conn.keys("rq:job:*")
               if stack.conn.hget(k, "origin") in (b"mlxq:ghost", b"mlxq:ghost@high")]
        for job_id in ids:  # cancelled jobs leave the tenant's count: there is room again
            client.delete(f"/jobs/{job_id}", cast_to=object)
        assert client.post("/jobs", cast_to=object, body={"prompt": "x", "model": "ghost"})["status"] == "queued"


def test_blocking_requests_release_their_slot(stack: Stack) -> None:
    """The read that finds a blocking request's result also takes its job out of the tenant's count."""
    client = stack.client("globex")
    ids = [client.chat.completions.with_raw_response.create(model="fake", messages=CHAT, max_tokens=2)
           .headers["x-mlxq-job-id"] for _ in range(3)]
    in_flight = stack.conn.zrange(api_keys.in_flight(Tenant("globex").tag), 0, -1)
    assert not {job_id.encode() for job_id in ids} & set(in_flight)


def test_no_key_means_loopback_only(stack: Stack) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLXQ_API")}
    result = subprocess.run([sys.executable, "-m", "mlxq", "api", "--url", stack.url, "--host", "0.0.0.0"],
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2 and "--insecure" in result.stderr
    with running_gateway(stack.url) as base:  # no keys, on loopback: everyone is the tenant "default"
        assert openai.OpenAI(base_url=base, api_key="anything", max_retries=0).models.list().data



@pytest.mark.slow
def test_greedy_chat_blocking_and_streamed_agree_on_the_tiny_model(redis_url: str, redis_conn: redis.Redis,
                                                                    tiny_model_dir: str) -> None:
    from tests.workers import start_worker

    worker = start_worker(redis_url, tiny_model_dir, name="tiny-worker")
    ask = dict(model="tiny", messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=24, temperature=0,
               extra_body={"return_token_ids": True, "ignore_eos": True})
    try:
        wait_live(redis_conn, "tiny-worker", timeout=120)
        with running_gateway(redis_url) as base:
            client = openai.OpenAI(base_url=base, api_key="local", max_retries=0, timeout=120)
            blocking = client.chat.completions.create(**ask)
            chunks = list(client.chat.completions.create(**ask, stream=True))
    finally:
        stop(worker)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    streamed_ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids", [])]
    assert blocking.usage.completion_tokens == 24
    assert streamed == blocking.choices[0].message.content and len(streamed) > 0
    assert streamed_ids == blocking.choices[0].model_extra["token_ids"]


def test_calls_of_one_loop_turn_share_one_run() -> None:
    import asyncio

    from producer.api.coalesce import Coalescer

    runs: list[list[int]] = []

    async def run_many(items: Any) -> list[int]:
        runs.append(list(items))
        if 13 in items:
            raise ValueError("unlucky")
        return [item * 2 for item in items]

    async def main() -> None:
        double = Coalescer(run_many)
        assert await asyncio.gather(*(double(i) for i in range(5))) == [0, 2, 4, 6, 8]
        assert await double(5) == 10
        outcomes = await asyncio.gather(double(12), double(13), return_exceptions=True)
        assert all(isinstance(outcome, ValueError) for outcome in outcomes)  # every caller of the batch sees it

    asyncio.run(main())
    assert runs == [[0, 1, 2, 3, 4], [5], [12, 13]]


def test_single_admissions_of_one_turn_share_one_call_and_keep_their_own_answers(redis_url: str) -> None:
    """Concurrent requests' admissions run in one script call, each under the caps as if alone: the
    tenant's cap holds in order, another tenant is not counted against it, and a job whose enqueue
    fails leaves its tenant's set while the others stay enqueued."""
    import asyncio

    import redis.asyncio as aioredis

    from producer.api.admission import Admission
    from producer.api.auth import ApiError
    from schemas.command_batch import CommandBatch
    from producer.wire import NO_CONNECTION

    acme, globex = Tenant("acme"), Tenant("globex")

    def pushing(job_id: str, broken: bool = False) -> CommandBatch:
        batch = CommandBatch(NO_CONNECTION)
        batch.rpush("rq:queue:mlxq:m", job_id)
        if broken:
            batch.execute_command("INCR", "rq:queue:mlxq:m")  # a list: WRONGTYPE
        return batch

    async def main() -> list[Any]:
        connection = aioredis.Redis.from_url(redis_url)
        admission = Admission(connection, tenant_cap=3, max_queue_depth=0)
        calls = 0
        script = admission._each_script

        async def counting(**kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            return await script(**kwargs)

        admission._each_script = counting  # type: ignore[assignment]
        jobs = [(acme, f"a{i}", i == 1) for i in range(5)] + [(globex, "g0", False)]
        outcomes = await asyncio.gather(*(admission.admit_one(tenant, job_id, "mlxq:m", pushing(job_id, broken))
                                          for tenant, job_id, broken in jobs), return_exceptions=True)
        await connection.aclose()
        assert calls == 1
        return outcomes

    outcomes = asyncio.run(main())
    conn = redis.Redis.from_url(redis_url)
    assert outcomes[0] is None and outcomes[2] is None and outcomes[3] is None and outcomes[5] is None
    assert isinstance(outcomes[1], redis.ResponseError) and "WRONGTYPE" in str(outcomes[1])
    assert isinstance(outcomes[4], ApiError) and outcomes[4].status == 429  # acme's fourth, over its cap of 3
    assert {m.decode() for m in conn.zrange(api_keys.in_flight(acme.tag), 0, -1)} == {"a0", "a2", "a3"}
    assert [m.decode() for m in conn.lrange("rq:queue:mlxq:m", 0, -1)] == ["a0", "a1", "a2", "a3", "g0"]
