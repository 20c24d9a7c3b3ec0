"""The gateway under attack, against a real redis-server and a real fake-engine worker.

Streams: one tenant's bad `Last-Event-ID`, another client ending the shared stream read with an error,
a stream whose own read fails; each costs at most the stream that caused it, and no job is cancelled
for it. Scripts flushed in a loop cost no request."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import redis

from mlxq.redis_server import RedisServer
from schemas import GenerationResult, keys
from tests.gateway import announce, key_entry, running_gateway, wait_live
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
        lines: list[str] = []
        assert worker.stdout is not None
        threading.Thread(target=lambda: lines.extend(iter(worker.stdout.readline, "")), daemon=True).start()
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

    def run(self) -> None:
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


def _alone(stack: Stack, tenant: str, prompt: str) -> str:
    """The same request's text, blocking, with nothing else going on."""
    response = httpx.post(f"{stack.base}/chat/completions", headers=stack.headers(tenant), timeout=60,
                          json={"model": "fake", "messages": [{"role": "user", "content": prompt}],
                                "max_tokens": TOKENS})
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


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
    announce(stack.conn, "nobody-serves-it", "idle-model")  # accepted by the gateway, never run
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
