"""The gateway under attack, against a real redis-server and a real fake-engine worker.

Streams: one tenant's bad `Last-Event-ID`, another client ending the shared stream read with an error,
a stream whose own read fails; each costs at most the stream that caused it, and no job is cancelled
for it. Scripts flushed in a loop cost no request. Small lies (a job read as `finished` without its
result, `"yes"` taken for true) and slow clients (held connections) are gone."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import redis

from mlxq.redis_server import RedisServer, free_port
from producer import Client
from producer.api import keys as api_keys
from schemas import GenerationResult, keys
from tests.gateway import announce, key_entry, running_gateway, wait_live
from tests.test_security import PRODUCER_ACL
from tests.workers import ScriptFlusher, rq_status, start_fake_worker, wait_for

pytestmark = pytest.mark.slow

KEYS = {"acme": "sk-acme-streams", "globex": "sk-globex-streams"}
TOKENS = 60  # at 20 ms a step, a stream of a bit more than a second


@dataclass
class Stack:
    url: str
    base: str
    conn: redis.Redis
    worker: subprocess.Popen[str]
    worker_lines: list[str]

    def headers(self, tenant: str, **more: Any) -> dict[str, Any]:
        return {"Authorization": f"Bearer {KEYS[tenant]}", **more}

    def result(self, job_id: str) -> GenerationResult | None:
        raw = self.conn.get(keys.result_key(job_id))
        return GenerationResult.model_validate_json(raw) if raw else None

    @property
    def worker_log(self) -> str:
        """The worker's output so far (what a failing assertion shows)."""
        return "".join(self.worker_lines[-200:])


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with RedisServer() as server:
        conn = redis.Redis.from_url(server.url)
        worker = start_fake_worker(server.url, "--model", "fake", step_delay_s=0.02)
        lines = worker.lines
        try:
            wait_live(conn, "fake")
            entries = ",".join(key_entry(tenant, key) for tenant, key in KEYS.items())
            with running_gateway(server.url, api_keys=entries) as base:
                yield Stack(server.url, base, conn, worker, lines)
        finally:
            worker.terminate()  # its output is drained by the thread above
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
            conn.close()


class ChatStream(threading.Thread):
    """A streamed chat request read to its end in a thread: its job id, text, finish reason, errors."""

    def __init__(self, stack: Stack, tenant: str, prompt: str, model: str = "fake", max_tokens: int = TOKENS) -> None:
        super().__init__(daemon=True)
        self.stack, self.tenant = stack, tenant
        self.body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                     "stream": True}
        self.job_id, self.text, self.finish, self.errors, self.done = "", "", None, [], False
        self.opened = threading.Event()
        self.status = 0
        self.broken: str | None = None  # how the connection broke before the stream's end, if it did

    def run(self) -> None:
        try:
            self._read()
        except httpx.HTTPError as exc:
            self.broken = repr(exc)

    def _read(self) -> None:
        with httpx.stream("POST", f"{self.stack.base}/chat/completions", headers=self.stack.headers(self.tenant),
                          json=self.body, timeout=60) as response:
            self.job_id = response.headers.get("x-mlxq-job-id", "")
            self.status = response.status_code
            self.opened.set()
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    self.done = True
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    self.errors.append(chunk["error"])
                    continue
                for choice in chunk["choices"]:
                    self.text += choice["delta"].get("content") or ""
                    self.finish = choice["finish_reason"] or self.finish


class MessagesStream(threading.Thread):
    """A streamed Anthropic Messages request read in a thread: its job id, text, whether it ended
    (`message_stop`), how its connection broke if it did."""

    def __init__(self, stack: Stack, tenant: str, prompt: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.headers = stack.base.removesuffix("/v1") + "/v1/messages", stack.headers(tenant)
        self.body = {"model": "fake", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                     "stream": True}
        self.job_id, self.text, self.done = "", "", False
        self.broken: str | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, headers=self.headers, json=self.body, timeout=60) as response:
                self.job_id = response.headers.get("x-mlxq-job-id", "")
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    event = json.loads(line[6:])
                    if event["type"] == "content_block_delta":
                        self.text += event["delta"].get("text", "")
                    self.done = self.done or event["type"] == "message_stop"
        except httpx.HTTPError as exc:
            self.broken = repr(exc)


def _alone(stack: Stack, tenant: str, prompt: str, max_tokens: int = TOKENS) -> str:
    """The same request's text, blocking, with nothing else going on."""
    response = httpx.post(f"{stack.base}/chat/completions", headers=stack.headers(tenant), timeout=60,
                          json={"model": "fake", "messages": [{"role": "user", "content": prompt}],
                                "max_tokens": max_tokens})
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


def _announce_idle_model(stack: Stack) -> None:
    """A live entry for `idle-model`, which no worker serves, and until the gateway lists it: the gateway
    reads the fleet at most once a second, so a request sent right after the entry is written may be
    answered 404."""
    announce(stack.conn, "nobody-serves-it", "idle-model")
    wait_for(lambda: "idle-model" in [m["id"] for m in httpx.get(f"{stack.base}/models", headers=stack.headers("acme"),
                                                                 timeout=30).json()["data"]],
             timeout=30, what="the gateway to list idle-model")


def _events(stack: Stack, tenant: str, job_id: str, last_event_id: bytes) -> httpx.Response:
    with httpx.stream("GET", f"{stack.base}/jobs/{job_id}/events", timeout=30,
                      headers=stack.headers(tenant, **{"Last-Event-ID": last_event_id})) as response:
        response.read()
        return response


BAD_EVENT_IDS = [b"99999999999999999999", b"99999999999999999999-1", b"18446744073709551616-0",
                 b"1-18446744073709551616", "1\u00b2".encode("latin-1"), "\uff11".encode(), b"-1", b"1-",
                 b"1-2-3", b"0x10", b"1 -2", b"9" * 64]


def test_a_tenants_bad_last_event_id_is_its_own_400_and_costs_no_other_stream(stack: Stack) -> None:
    expected = {prompt: _alone(stack, tenant, prompt) for tenant, prompt in (("acme", "one"), ("globex", "two"))}
    victims = [ChatStream(stack, "acme", "one"), ChatStream(stack, "globex", "two")]
    for victim in victims:
        victim.start()
    for victim in victims:
        assert victim.opened.wait(30)
    attacker_job = httpx.post(f"{stack.base}/jobs", headers=stack.headers("globex"), timeout=30,
                              json={"model": "fake", "prompt": "x", "max_tokens": 400, "stream": True}).json()["id"]
    answers = []
    for _ in range(3):
        for bad in BAD_EVENT_IDS:
            response = _events(stack, "globex", attacker_job, bad)
            answers.append((bad, response.status_code, response.json()))
        time.sleep(0.1)
    for victim in victims:
        victim.join(timeout=60)
    for bad, status, body in answers:
        assert status == 400, (bad, status, body)
        assert body["error"]["param"] == "Last-Event-ID" and "Last-Event-ID" in body["error"]["message"], body
    for victim in victims:
        assert victim.done and not victim.errors, (victim.errors, stack.worker_log)
        assert victim.text == expected[victim.body["messages"][0]["content"]] and victim.finish == "length"
        result = stack.result(victim.job_id)
        assert result is not None and result.status == "finished", result
    # The largest id Redis has is a valid place to resume from: after it there is only the end.
    wait_for(lambda: stack.result(attacker_job) is not None, timeout=60, what="the attacker's own job to end")
    response = _events(stack, "globex", attacker_job, b"18446744073709551615-18446744073709551615")
    assert response.status_code == 200 and "event: end" in response.text, response.text


def test_another_client_ending_the_shared_read_with_errors_costs_no_stream(stack: Stack) -> None:
    """`CLIENT UNBLOCK <id> ERROR` at every blocked stream read, over and over, while four streams of
    two tenants run: each ends whole, with the text it has alone."""
    prompts = [("acme", "a1"), ("acme", "a2"), ("globex", "g1"), ("globex", "g2")]
    expected = {prompt: _alone(stack, tenant, prompt) for tenant, prompt in prompts}
    streams = [ChatStream(stack, tenant, prompt) for tenant, prompt in prompts]
    for stream in streams:
        stream.start()
    unblocked = 0
    while any(stream.is_alive() for stream in streams):
        for client in stack.conn.client_list():
            if client.get("cmd") == "xread":
                unblocked += stack.conn.execute_command("CLIENT", "UNBLOCK", int(client["id"]), "ERROR")
        time.sleep(0.01)
    for stream in streams:
        assert stream.done and not stream.errors, (stream.errors, stack.worker_log)
        assert stream.text == expected[stream.body["messages"][0]["content"]] and stream.finish == "length"
        assert stack.result(stream.job_id).status == "finished"  # type: ignore[union-attr]
    assert unblocked > 10  # the attack reached the gateway's read, again and again


def test_a_stream_whose_own_read_fails_ends_alone_and_its_job_is_not_cancelled(stack: Stack) -> None:
    """A queued job's stream key stops being a stream while the gateway follows it: that stream gets
    an error naming where the result will be, its job stays queued (not cancelled), and a stream of
    another tenant beside it ends whole."""
    expected = _alone(stack, "acme", "beside")
    _announce_idle_model(stack)  # accepted by the gateway, never run
    broken = ChatStream(stack, "globex", "never runs", model="idle-model")
    broken.start()
    assert broken.opened.wait(30) and broken.job_id, broken.status
    time.sleep(0.5)  # it is followed by the gateway's shared read now
    beside = ChatStream(stack, "acme", "beside")
    beside.start()
    time.sleep(0.3)
    stack.conn.set(keys.stream_key(broken.job_id), "not a stream")
    broken.join(timeout=30)
    beside.join(timeout=60)
    assert broken.done and len(broken.errors) == 1, broken.errors
    assert f"/v1/jobs/{broken.job_id}" in broken.errors[0]["message"], broken.errors
    assert not stack.conn.exists(keys.cancel_key(broken.job_id))
    assert rq_status(stack.url, broken.job_id) == "queued" and stack.result(broken.job_id) is None
    assert beside.done and not beside.errors and beside.text == expected, (beside.errors, stack.worker_log)


def test_scripts_flushed_in_a_loop_cost_no_request(stack: Stack) -> None:
    """Admission (the gateway's scripts), enqueueing and the worker's polls all run scripts: with the
    server's script cache emptied about every millisecond, blocking and streamed requests of two
    tenants still all answer 200 with their text, and the worker lives on."""
    prompts = [("acme", f"f{i}") for i in range(4)] + [("globex", f"g{i}") for i in range(4)]
    expected = {prompt: _alone(stack, tenant, prompt) for tenant, prompt in prompts}
    answers: dict[str, Any] = {}

    def blocking(tenant: str, prompt: str) -> None:
        response = httpx.post(f"{stack.base}/chat/completions", headers=stack.headers(tenant), timeout=60,
                              json={"model": "fake", "messages": [{"role": "user", "content": prompt}],
                                    "max_tokens": TOKENS})
        answers[prompt] = (response.status_code, response.json())

    with ScriptFlusher(redis.Redis.from_url(stack.url)) as flusher:
        streams = [ChatStream(stack, tenant, prompt) for tenant, prompt in prompts[::2]]
        callers = [threading.Thread(target=blocking, args=p) for p in prompts[1::2]]
        for thread in [*streams, *callers]:
            thread.start()
            time.sleep(0.05)
        for thread in [*streams, *callers]:
            thread.join(timeout=60)
    assert flusher.flushes > 100
    for stream in streams:
        assert stream.status == 200 and stream.done and not stream.errors, (stream.errors, stack.worker_log)
        assert stream.text == expected[stream.body["messages"][0]["content"]]
    for prompt, (status, body) in answers.items():
        assert status == 200, body
        assert body["choices"][0]["message"]["content"] == expected[prompt]
    assert stack.worker.poll() is None, stack.worker_log


def _whereabouts(conn: redis.Redis, job_id: str) -> dict[str, Any]:
    """Every list, set and sorted set that names `job_id`, and its job hash's status (a lost job's trail)."""
    found: dict[str, Any] = {"status": conn.hget(f"rq:job:{job_id}", "status")}
    for key in conn.scan_iter(count=1000):
        kind = conn.type(key)
        members = (conn.lrange(key, 0, -1) if kind == b"list" else conn.smembers(key) if kind == b"set"
                   else conn.zrange(key, 0, -1, withscores=True) if kind == b"zset" else [])
        for member in members:
            if job_id in repr(member):
                found[key.decode()] = member
    return found


class BusyScript(threading.Thread):
    """A producer holding the documented ACL runs a Lua loop (EVAL is in its rights) that keeps the
    server busy for about `seconds`: past `busy-reply-threshold` every other command is answered BUSY."""

    LOOP = "local i = 0 while i < tonumber(ARGV[1]) do i = i + 1 end return i"

    def __init__(self, url: str, seconds: float) -> None:
        super().__init__(name="busy-script", daemon=True)
        admin = redis.Redis.from_url(url)
        name, *rules = PRODUCER_ACL.split()
        admin.execute_command("ACL", "SETUSER", name, "reset", *rules)
        port = admin.connection_pool.connection_kwargs["port"]
        self.producer = redis.Redis(host="127.0.0.1", port=port, username=name, password="producer-secret",
                                    socket_timeout=60)
        started = time.monotonic()
        self.producer.eval(self.LOOP, 0, 2_000_000)  # the loop's speed, to size it
        self.iterations = int(2_000_000 * seconds / max(time.monotonic() - started, 1e-3))
        self.busy_replies = 0

    def run(self) -> None:
        try:
            self.producer.eval(self.LOOP, 0, self.iterations)
        except redis.ResponseError as exc:  # past the threshold even its own reply may read BUSY
            assert "BUSY" in str(exc), exc


def test_a_producers_script_holding_the_server_costs_no_worker_stream_or_request(stack: Stack) -> None:
    """With the server held by a producer's script for about 3 s, and answering BUSY after 0.3 s of it,
    Redis is away for everyone, and is treated so: the worker waits for it as for a lost connection (it
    died of the error, failing its jobs); a request answers 503 in OpenAI's shape (a plain-text 500
    before), or 200 with its text alone; a stream across the window ends whole with its text alone or,
    where its own reads met the server away, with an error naming where its result will be; no job is
    cancelled: each ends finished."""
    prompts = [("acme", "busy-a"), ("globex", "busy-g"), ("acme", "busy-b")]
    expected = {prompt: _alone(stack, tenant, prompt, max_tokens=150) for tenant, prompt in prompts}
    admin = redis.Redis.from_url(stack.url)
    threshold = admin.config_get("busy-reply-threshold")["busy-reply-threshold"]
    admin.config_set("busy-reply-threshold", 300)
    try:
        streams = [ChatStream(stack, tenant, prompt, max_tokens=150) for tenant, prompt in prompts[:2]]
        answers: list[httpx.Response] = []
        blocking = threading.Thread(target=lambda: answers.append(httpx.post(
            f"{stack.base}/chat/completions", headers=stack.headers("acme"), timeout=60,
            json={"model": "fake", "messages": [{"role": "user", "content": "busy-b"}], "max_tokens": 150})))
        for stream in streams:
            stream.start()
        blocking.start()
        for stream in streams:
            assert stream.opened.wait(30)
        busy = BusyScript(stack.url, seconds=3)
        busy.start()
        time.sleep(0.5)
        during = httpx.post(f"{stack.base}/jobs", headers=stack.headers("globex"), timeout=60,
                            json={"model": "fake", "prompt": "during", "max_tokens": 5})
        busy.join(timeout=60)
        blocking.join(timeout=60)
        for stream in streams:
            stream.join(timeout=60)
    finally:
        admin.config_set("busy-reply-threshold", threshold)
    assert stack.worker.poll() is None, stack.worker_log
    assert "ServerBusy" in stack.worker_log, stack.worker_log
    wait_for(lambda: "Redis is back" in stack.worker_log, timeout=30, what="the worker to see Redis back")
    for stream in streams:
        job_status = getattr(stack.result(stream.job_id), "status", None)
        assert stream.status == 200 and stream.done, (
            f"job {stream.job_id} ({job_status}): still reading {stream.is_alive()}, {len(stream.text)} "
            f"characters, finish {stream.finish}, errors {stream.errors}, connection broken: {stream.broken}; "
            f"the job is in {_whereabouts(stack.conn, stream.job_id)}\n"
            + "".join(line for line in stack.worker_lines if "cleaning registries" not in line)[-30_000:])
        if stream.errors:
            assert len(stream.errors) == 1 and f"/v1/jobs/{stream.job_id}" in stream.errors[0]["message"], stream.errors
        else:
            assert stream.text == expected[stream.body["messages"][0]["content"]]
        wait_for(lambda: stack.result(stream.job_id) is not None, timeout=30, what="the stream's job to end")
        assert stack.result(stream.job_id).status == "finished"  # type: ignore[union-attr]
    for answer in (during, *answers):
        assert answer.status_code in (200, 503), (answer.status_code, answer.text)
        if answer.status_code == 503:
            assert answer.json()["error"]["code"] == "broker_error", answer.text
    if answers[0].status_code == 200:
        assert answers[0].json()["choices"][0]["message"]["content"] == expected["busy-b"]
    job_id = answers[0].headers.get("x-mlxq-job-id")
    if job_id:
        wait_for(lambda: stack.result(job_id) is not None, timeout=30, what="the blocking request's job to end")
        assert stack.result(job_id).status == "finished"  # type: ignore[union-attr]


# ---------------------------------------------------------------- small lies and slow clients


def test_a_job_read_while_it_ends_is_never_finished_without_its_result(stack: Stack) -> None:
    """`GET /v1/jobs/{id}` polled by eight clients at once while the job ends (its result key written as a
    worker writes it, first, then RQ's status): status and result come from one read, so no answer is
    `finished` with `result: null`."""
    _announce_idle_model(stack)
    job_ids = [httpx.post(f"{stack.base}/jobs", headers=stack.headers("acme"), timeout=30,
                          json={"model": "idle-model", "prompt": f"p{i}"}).json()["id"] for i in range(30)]
    current = [job_ids[0]]
    answers: list[tuple[str, Any]] = []
    stopping = threading.Event()

    def poll() -> None:
        with httpx.Client(headers=stack.headers("acme"), timeout=30) as http:
            while not stopping.is_set():
                body = http.get(f"{stack.base}/jobs/{current[0]}").json()
                answers.append((body["status"], body["result"]))

    pollers = [threading.Thread(target=poll) for _ in range(8)]
    for thread in pollers:
        thread.start()
    rng = random.Random(5)
    for job_id in job_ids:
        current[0] = job_id
        time.sleep(rng.uniform(0.02, 0.06))
        ended = GenerationResult(id=job_id, status="finished", choices=[], worker="test")
        stack.conn.set(keys.result_key(job_id), ended.model_dump_json(), ex=600)
        time.sleep(rng.uniform(0.0, 0.01))
        stack.conn.hset(f"rq:job:{job_id}", "status", "finished")
        time.sleep(0.02)
    stopping.set()
    for thread in pollers:
        thread.join(timeout=30)
    final = [(status, result) for status, result in answers if status == "finished"]
    assert len(final) > len(job_ids), len(answers)
    lies = [answer for answer in final if answer[1] is None]
    assert not lies, f"{len(lies)} of {len(final)} reads said finished without a result"


def test_a_json_boolean_is_a_boolean(stack: Stack) -> None:
    """`logprobs: "yes"` (or a number in a string) is refused naming the field, as OpenAI refuses it."""
    chat = {"model": "fake", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for field, value in (("logprobs", "yes"), ("stream", "true"), ("max_tokens", "5"), ("temperature", "0.5"),
                         ("n", 1.0), ("ignore_eos", 1), ("top_logprobs", "2")):
        response = httpx.post(f"{stack.base}/chat/completions", headers=stack.headers("acme"), timeout=30,
                              json={**chat, field: value})
        assert response.status_code == 400 and response.json()["error"]["param"] == field, (field, response.text)
    response = httpx.post(f"{stack.base}/jobs", headers=stack.headers("acme"), timeout=30,
                          json={"model": "fake", "prompt": "x", "logprobs": "yes"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "logprobs", response.text
    ok = httpx.post(f"{stack.base}/chat/completions", headers=stack.headers("acme"), timeout=30,
                    json={**chat, "logprobs": True, "temperature": 0})  # an integer where a number goes: fine
    assert ok.status_code == 200, ok.text


def _closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Whether the server closed `sock` within `seconds`, and what it sent before."""
    sock.settimeout(seconds)
    received = b""
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return True, received
            received += data
    except socket.timeout:
        return False, received
    except ConnectionResetError:
        return True, received


def _slow_clients(base: str) -> dict[str, socket.socket]:
    """Three clients that never finish a request: silent, a header a byte at a time, a body never sent."""
    host, port = base.removeprefix("http://").split("/")[0].split(":")
    clients = {name: socket.create_connection((host, int(port))) for name in ("silent", "trickle", "no-body")}
    clients["trickle"].sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
    clients["no-body"].sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                               b"Content-Length: 100\r\n\r\n{\"prompt\":")
    return clients


def _keep_trickling(sock: socket.socket, stop: threading.Event) -> None:
    while not stop.wait(0.2):
        try:
            sock.sendall(b"X")
        except OSError:
            return


def test_slow_clients_are_cut_off_and_responses_are_not(stack: Stack) -> None:
    """With 1 s deadlines: a connection that sends nothing, one that sends its header a byte every 0.2 s
    and one that never finishes its body are each closed (a 408 where the head was incomplete), while
    a blocking request and a stream that take longer than the deadlines are answered whole."""
    entries = ",".join(key_entry(tenant, key) for tenant, key in KEYS.items())
    with running_gateway(stack.url, api_keys=entries, header_timeout_s=1, body_timeout_s=1) as base:
        clients = _slow_clients(base)
        stop = threading.Event()
        threading.Thread(target=_keep_trickling, args=(clients["trickle"], stop), daemon=True).start()
        slow_answer = ChatStream(Stack(stack.url, base, stack.conn, stack.worker, stack.worker_lines), "acme", "slow",
                                 max_tokens=150)  # about 3 s of tokens
        slow_answer.start()
        blocking = httpx.post(f"{base}/chat/completions", headers=stack.headers("globex"), timeout=60,
                              json={"model": "fake", "messages": [{"role": "user", "content": "b"}],
                                    "max_tokens": 150})
        outcomes = {name: _closed_within(sock, 15) for name, sock in clients.items()}
        stop.set()
        slow_answer.join(timeout=60)
        for sock in clients.values():
            sock.close()
    for name, (closed, sent) in outcomes.items():
        assert closed, f"the {name} client was not cut off"
        if name != "no-body":
            assert sent.startswith(b"HTTP/1.1 408"), (name, sent)
    assert blocking.status_code == 200, blocking.text
    assert slow_answer.done and not slow_answer.errors and slow_answer.finish == "length", slow_answer.errors


def test_mlxq_api_takes_its_settings_as_documented(stack: Stack) -> None:
    """`mlxq api` as a process, configured by the environment as docs/configuration.md writes it:
    `MLXQ_API_ADMIN_TENANTS=ops` lets ops (only) drive the control plane, the header deadline cuts off a
    silent client, and on SIGTERM the streams open get `MLXQ_API_SHUTDOWN_GRACE_S`: one that ends within
    it ends whole, one cut after it leaves its job running."""
    keys_ = {"ops": "sk-ops-1", "acme": KEYS["acme"]}
    port = free_port()
    env = {**os.environ, "MLXQ_REDIS_URL": stack.url, "MLXQ_API_ADMIN_TENANTS": "ops",
           "MLXQ_API_KEYS": ",".join(key_entry(tenant, key) for tenant, key in keys_.items()),
           "MLXQ_API_HEADER_TIMEOUT_S": "1", "MLXQ_API_SHUTDOWN_GRACE_S": "5"}
    # At info, uvicorn logs each step of its shutdown: a shutdown that hangs shows where.
    proc = subprocess.Popen([sys.executable, "-m", "mlxq", "api", "--port", str(port), "--log-level", "info"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}/v1"
    this_api = Stack(stack.url, base, stack.conn, stack.worker, stack.worker_lines)
    short, long = (ChatStream(this_api, "acme", prompt, max_tokens=tokens)
                   for prompt, tokens in (("ends-in-grace", 20), ("cut-at-shutdown", 3000)))
    long_message = MessagesStream(this_api, "acme", "a-message-cut-at-shutdown", 3000)
    try:
        wait_for(lambda: proc.poll() is not None or _answers(base), timeout=60, what="mlxq api to listen")
        assert proc.poll() is None, proc.communicate()[0]
        answers = {tenant: httpx.post(f"{base}/control/fake/reset_prefix_cache", json={"timeout": 5}, timeout=30,
                                      headers={"Authorization": f"Bearer {key}"}).status_code
                   for tenant, key in keys_.items()}
        silent = socket.create_connection(("127.0.0.1", port))
        closed, sent = _closed_within(silent, 15)
        silent.close()
        for stream in (long, long_message, short):
            stream.start()
            wait_for(lambda: stream.text, timeout=30, what=f"the first token of {stream.body}")
    finally:
        proc.terminate()
        try:
            out = proc.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"mlxq api did not exit within 30 s of SIGTERM:\n{proc.communicate()[0]}") from None
    for stream in (short, long, long_message):
        stream.join(timeout=30)
    long_status, message_status = (rq_status(stack.url, cut.job_id) for cut in (long, long_message))
    for stream in (long, long_message):
        Client(stack.url).cancel(stream.job_id)  # its 3,000 tokens would hold the worker for a minute
    assert answers == {"ops": 200, "acme": 403}, out
    assert closed and sent.startswith(b"HTTP/1.1 408"), out
    assert short.done and short.finish == "length" and short.text == _alone(stack, "acme", "ends-in-grace", 20), out
    tenant_tag = short.job_id.rsplit("-", 1)[0]  # a job id names its tenant
    assert stack.conn.zscore(api_keys.in_flight(tenant_tag), short.job_id) is None, "the whole stream kept its slot"
    assert long.broken and not long.done and long.text and long_status == "started", (long_status, out)
    assert long_message.broken and not long_message.done and message_status == "started", (message_status, out)


def _answers(base: str) -> bool:
    try:
        return httpx.get(f"{base}/models", timeout=2).status_code in (200, 401)
    except httpx.HTTPError:
        return False
