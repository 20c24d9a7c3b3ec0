"""The tenant-attack suite's attackers, one thread per class of issue 33, each as a hostile tenant
(mallory, through the gateway), producer (Redis under the documented producer ACL) or trainer (its
ACL from docs/rl.md) would act, and one attack of this suite's own per class. What the door refuses
is checked as it answers; every hostile job with an id goes in the ledger with what it must end as."""

from __future__ import annotations

import json
import random
import select
import socket
import time
import uuid
import zlib
from pathlib import Path
from typing import Any, Optional

import redis

from producer import Client
from schemas import GenerationResult, keys
from tests.attack_stack import TENANT_KEYS, TINY_WORKERS, Stack
from tests.attack_traffic import Actor, Ledger, sse

def job_data(request: object, function: str = keys.JOB_FUNCTION) -> bytes:
    return json.dumps([function, None, [], {"request": request}]).encode()


def job_fields(request: object = None, queue: str = "mlxq:tiny", **overrides: object) -> dict[str, object]:
    fields: dict[str, object] = {"data": job_data(request or {"prompt_token_ids": [5, 6, 7], "max_tokens": 4}),
                                 "status": "queued", "origin": queue, "created_at": "2026-11-30T00:00:00.000000Z",
                                 "enqueued_at": "2026-11-30T00:00:00.000000Z"}
    fields.update(overrides)
    return {k: v for k, v in fields.items() if v is not None}


def plant(conn: redis.Redis, job_id: str, fields: Optional[dict[str, object]], queue: str) -> None:
    """A job hash and its queue entry, written as a producer in another language writes them."""
    if fields:
        conn.hset(f"rq:job:{job_id}", mapping=fields)  # type: ignore[arg-type]
    conn.rpush(f"rq:queue:{queue}", job_id)


def refused(attempt: Any) -> bool:
    """Whether a Redis call was refused for want of permission (NOPERM)."""
    try:
        attempt()
    except redis.exceptions.NoPermissionError:
        return True
    except redis.exceptions.ResponseError as exc:  # DEBUG: off in the server's configuration, before the ACL
        return "not allowed" in str(exc)
    return False


def json_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}


def error_param(response: Any) -> Optional[str]:
    try:
        return response.json()["error"]["param"]
    except (ValueError, KeyError, TypeError):
        return None


def gateway_address(stack: Stack) -> tuple[str, int]:
    host, port = stack.base.removeprefix("http://").split("/")[0].split(":")
    return host, int(port)


# ---------------------------------------------------------------- 1: streams


BAD_EVENT_IDS = [b"99999999999999999999", b"99999999999999999999-1", b"18446744073709551616-0",
                 b"1-18446744073709551616", "1\u00b2".encode("latin-1"), "\uff11".encode(), b"-1", b"1-",
                 b"1-2-3", b"0x10", b"1 -2", b"9" * 64]


class StreamAttack(Actor):
    """Out-of-range and malformed `Last-Event-ID`s on mallory's own stream; another tenant's ids read,
    streamed and cancelled; `CLIENT UNBLOCK` and friends from the hostile producer. Own: a streamed
    reply that mallory never reads, then drops."""

    attack = "streams"

    def __init__(self, stack: Stack, ledger: Ledger) -> None:
        super().__init__(stack, ledger)
        self.hostile = stack.redis_as("hostile")
        self.rng = random.Random(1)

    def round(self) -> None:
        with self.stack.http("mallory") as http:
            job = http.post("/jobs", json={"model": "fake", "prompt": f"m{self.rng.random()}", "max_tokens": 60,
                                           "stream": True})
            self.check(job.status_code == 200, f"submit: {job.status_code} {job.text[:200]}")
            job_id = job.json()["id"]
            self.ledger.expect(job_id, self.attack, "finished")
            for bad in self.rng.sample(BAD_EVENT_IDS, 4):
                answer = http.get(f"/jobs/{job_id}/events", headers={"Last-Event-ID": bad})
                if self.check(answer.status_code == 400 and error_param(answer) == "Last-Event-ID",
                              f"Last-Event-ID {bad!r}: {answer.status_code} {answer.text[:200]}"):
                    self.count("bad Last-Event-ID refused (400, named)")
            for good_id in self.ledger.some_good_jobs(3):
                for method, path in (("GET", f"/jobs/{good_id}"), ("GET", f"/jobs/{good_id}/events"),
                                     ("DELETE", f"/jobs/{good_id}")):
                    answer = http.request(method, path)
                    if self.check(answer.status_code == 404, f"{method} acme's {path}: {answer.status_code}"):
                        self.count("another tenant's job: 404")
        for attempt in (lambda: self.hostile.execute_command("CLIENT", "UNBLOCK", self.rng.randint(1, 400), "ERROR"),
                        lambda: self.hostile.execute_command("CLIENT", "LIST"),
                        lambda: self.hostile.execute_command("CLIENT", "KILL", "ID", self.rng.randint(1, 400)),
                        lambda: self.hostile.execute_command("CLIENT", "PAUSE", 1000),
                        lambda: self.hostile.execute_command("CLIENT", "TRACKING", "on")):
            if self.check(refused(attempt), "the producer ACL let a CLIENT subcommand through"):
                self.count("CLIENT UNBLOCK/LIST/KILL/PAUSE/TRACKING refused")
        self._never_read()

    def _never_read(self) -> None:
        """A big streamed reply (top-20 logprobs on every token) whose reader reads its head and then
        nothing for 3 s, then goes: its job is cancelled (or ended first), no one else waits on it."""
        body = json.dumps({"model": "fake", "messages": [{"role": "user", "content": "flood"}], "max_tokens": 1500,
                           "stream": True, "logprobs": True, "top_logprobs": 20}).encode()
        sock = socket.create_connection(gateway_address(self.stack))
        try:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + f"Authorization: Bearer {TENANT_KEYS['mallory']}\r\n".encode()
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = sock.recv(1)
                if not chunk:
                    break
                head += chunk
            job_id = next((line.split(b":", 1)[1].strip().decode() for line in head.split(b"\r\n")
                           if line.lower().startswith(b"x-mlxq-job-id:")), None)
            if not self.check(job_id is not None and head.startswith(b"HTTP/1.1 200"), f"flood: {head[:200]!r}"):
                return
            self.ledger.expect(job_id, self.attack, "cancelled")
            self.ledger.stopping.wait(3)
            self.count("streams never read, then dropped")
        finally:
            sock.close()


# ---------------------------------------------------------------- 2: constraints


ENDLESS = {"$ref": "#/$defs/node", "$defs": {"node": {
    "type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}, "required": ["next"]}}}
FAILS_MIDWAY = {"type": "object", "patternProperties": {"^x$": {"$ref": "#"}}, "required": ["x"],
                "additionalProperties": False}
AT_THE_DOOR = [  # refused by the gateway, naming the field
    ({"guided_grammar": 'start: "a" start'}, "guided_grammar"),
    ({"guided_grammar": 'start: a\na: "x" b\nb: "y" a'}, "guided_grammar"),
    ({"guided_regex": "(a{1000}){1000}"}, "guided_regex"),
    ({"guided_grammar": "start: /(a{1000}){1000}/"}, "guided_grammar"),
    ({"response_format": json_format(ENDLESS)}, "response_format"),
    ({"guided_regex": "a" * 3, "guided_grammar": 'start: "a"'}, None),  # two constraints: some field named
]
IN_THE_WORKER = [  # pass the gateway's checks; the worker fails the job alone, naming the field
    ({"response_format": json_format(FAILS_MIDWAY), "max_tokens": 20}, "the constraint failed"),
    ({"guided_grammar": 'start: A\nA: "a" & /b/'}, "allows no text"),
]


class ConstraintAttack(Actor):
    """Grammars with no finite document and regexes of huge repetition at the gateway (chat and
    jobs) and planted straight on a queue by the hostile producer; constraints that fail in the
    matcher. Own: a regex just under the repetition cap, never completed in its few tokens."""

    attack = "constraints"

    def __init__(self, stack: Stack, ledger: Ledger) -> None:
        super().__init__(stack, ledger)
        self.hostile = stack.redis_as("hostile")
        self.n = 0

    def round(self) -> None:
        self.n += 1
        with self.stack.http("mallory") as http:
            for extra, field in AT_THE_DOOR:
                for path, body in (("/jobs", {"model": "tiny", "prompt": "x", "max_tokens": 8, **extra}),
                                   ("/chat/completions", {"model": "tiny", "max_tokens": 8, **extra,
                                                          "messages": [{"role": "user", "content": "x"}]})):
                    answer = http.post(path, json=body)
                    param = error_param(answer) or ""
                    if self.check(answer.status_code == 400 and param and (field is None or param.startswith(field)),
                                  f"{path} {list(extra)}: {answer.status_code} {answer.text[:300]}"):
                        self.count("refused at the door (400, named)")
            for extra, needle in IN_THE_WORKER:
                answer = http.post("/jobs", json={"model": "tiny", "prompt": "x", "max_tokens": 8, "temperature": 0,
                                                  **extra})
                if self.check(answer.status_code == 200, f"in-worker {list(extra)}: {answer.text[:300]}"):
                    self.ledger.expect(answer.json()["id"], self.attack, "failed", needle)
            near_cap = http.post("/jobs", json={"model": "tiny", "prompt": "x", "max_tokens": 3, "temperature": 0,
                                                "guided_regex": "[a-z]{4000}"})
            if self.check(near_cap.status_code == 200, f"near the cap: {near_cap.text[:300]}"):
                self.ledger.expect(near_cap.json()["id"], self.attack, "incomplete")
        for extra, field in AT_THE_DOOR[:5]:
            job_id = f"planted-constraint-{self.n}-{field}-{uuid.uuid4().hex[:6]}"
            plant(self.hostile, job_id, job_fields({"prompt": "x", "max_tokens": 8, **extra}), "mlxq:tiny")
            self.ledger.expect(job_id, self.attack, "failed", field)
        self.ledger.stopping.wait(1.0)


# ---------------------------------------------------------------- 3: processed logprobs


PROCESSED = {"logprobs_mode": "processed", "top_k": 3, "response_format": {"type": "json_object"},
             "temperature": 0.8}


class LogprobAttack(Actor):
    """`logprobs_mode: "processed"` with `top_k` and `response_format` (tokens outside the processed
    support: -inf) blocking, streamed, as a job polled while it runs, and in a batch file. Own: `n` 4
    with top_k 1 and top_logprobs 20 (19 of every 20 alternatives outside the support)."""

    attack = "logprobs"
    pause_s = 0.3

    def __init__(self, stack: Stack, ledger: Ledger) -> None:
        super().__init__(stack, ledger)
        self.n = 0
        self.batches: list[str] = []

    def round(self) -> None:
        self.n += 1
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "json please"}], "max_tokens": 12,
                "logprobs": True, "top_logprobs": 5, "seed": self.n, **PROCESSED}
        with self.stack.http("mallory") as http:
            blocking = http.post("/chat/completions", json=chat)
            if self.check(blocking.status_code == 200, f"blocking: {blocking.status_code} {blocking.text[:300]}"):
                content = blocking.json()["choices"][0]["logprobs"]["content"]
                self.count("null top logprobs seen", sum(t["logprob"] is None for e in content
                                                         for t in e["top_logprobs"]))
            done, errors = False, []
            with http.stream("POST", "/chat/completions", json={**chat, "stream": True}) as response:
                self.check(response.status_code == 200, f"stream: {response.status_code}")
                for _, data in sse(response):
                    done = done or data == "[DONE]"
                    if data != "[DONE]" and "error" in json.loads(data):
                        errors.append(data)
            self.check(done and not errors, f"stream cut: done={done} {errors[:2]}")
            wide = http.post("/chat/completions", json={**chat, "n": 4, "top_k": 1, "top_logprobs": 20})
            self.check(wide.status_code == 200, f"n=4 top_k=1: {wide.status_code} {wide.text[:300]}")
            job = http.post("/jobs", json={"model": "tiny", "prompt": "x", "max_tokens": 12, "logprobs": True,
                                           "top_logprobs": 5, "seed": self.n, **PROCESSED})
            if self.check(job.status_code == 200, f"job: {job.text[:300]}"):
                job_id = job.json()["id"]
                self.ledger.expect(job_id, self.attack, "finished")
                for _ in range(200):  # polled while it runs and once it ended: each answer readable
                    polled = http.get(f"/jobs/{job_id}")
                    if not self.check(polled.status_code == 200, f"GET job: {polled.status_code} {polled.text[:300]}"):
                        break
                    if polled.json()["result"] is not None:
                        GenerationResult.model_validate(polled.json()["result"])
                        break
                    time.sleep(0.05)
            self.count("requests with -inf logprobs answered")
            if self.n % 5 == 1:
                self._batch(http, chat)

    def _batch(self, http: Any, chat: dict[str, Any]) -> None:
        lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                  "body": {**chat, "seed": i}} for i in range(3)]
        lines.append({"custom_id": "plain", "method": "POST", "url": "/v1/chat/completions",
                      "body": {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}})
        content = "".join(json.dumps(line) + "\n" for line in lines).encode()
        upload = http.post("/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"})
        if not self.check(upload.status_code == 200, f"upload: {upload.text[:300]}"):
            return
        batch = http.post("/batches", json={"input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions",
                                            "completion_window": "24h"})
        if self.check(batch.status_code == 200, f"batch: {batch.text[:300]}"):
            self.batches.append(batch.json()["id"])
            self.count("batches with -inf logprob lines")

    def batches_completed(self) -> list[str]:
        """What is wrong with the batches: each must complete with every line in its output."""
        problems = []
        with self.stack.http("mallory") as http:
            for batch_id in self.batches:
                batch = http.get(f"/batches/{batch_id}").json()
                counts = batch.get("request_counts") or {}
                if batch.get("status") != "completed" or counts.get("completed") != 4:
                    problems.append(f"{batch_id}: {batch.get('status')} {counts} {batch.get('errors')}")
        return problems


# ---------------------------------------------------------------- 4: weights


class WeightAttack(Actor):
    """A trainer (its own ACL) publishing broken versions (truncated, overlapping, short ranges, NaN,
    inf) and broken adapters, from a path and uploaded, under each policy; the admin tenant doing the
    same through the gateway; mallory trying. Own: garbage on the control stream, and a well-formed
    weights command whose uploaded chunks do not exist."""

    attack = "weights"
    pause_s = 0.5

    def __init__(self, stack: Stack, ledger: Ledger, broken: dict[str, Path], bad_adapters: dict[str, Path]) -> None:
        super().__init__(stack, ledger)
        self.trainer = Client(stack.url_as("trainer"))
        self.trainer_conn = stack.redis_as("trainer")
        self.broken, self.bad_adapters = broken, bad_adapters
        self.version = 0
        self.rng = random.Random(4)

    def round(self) -> None:
        self.version += 1
        how = self.rng.choice(sorted(self.broken))
        policy = self.rng.choice(["drain", "abort", "inflight"])
        outcome = self.trainer.publish_weights("tiny", self.version, str(self.broken[how]), policy,
                                               upload=self.rng.random() < 0.5, timeout=60)
        if self.check(not outcome.ok and set(outcome.errors) == set(TINY_WORKERS) and outcome.withdrawn,
                      f"{how} under {policy}: {outcome.model_dump_json()[:600]}"):
            self.count(f"broken version refused and withdrawn ({how})")
        self.check(self.stack.admin.get(keys.weights_key("tiny")) is None, "a refused version stayed published")
        name = self.rng.choice(sorted(self.bad_adapters))
        adapter = self.trainer.publish_adapter("tiny", f"bad-{name}", str(self.bad_adapters[name]),
                                               upload=self.rng.random() < 0.5, timeout=60)
        if self.check(not adapter.ok and adapter.withdrawn, f"adapter {name}: {adapter.model_dump_json()[:600]}"):
            self.count("broken adapter refused and withdrawn")
        with self.stack.http("ops") as http:
            answer = http.post("/control/tiny/weights", json={"version": self.version, "path": str(self.broken[how]),
                                                              "policy": policy, "timeout": 60})
            if self.check(answer.status_code == 200 and answer.json()["ok"] is False,
                          f"admin publish: {answer.status_code} {answer.text[:400]}"):
                self.count("broken version through the gateway refused")
        with self.stack.http("mallory") as http:
            answer = http.post("/control/tiny/weights", json={"version": 1, "path": "/", "timeout": 5})
            if self.check(answer.status_code == 403, f"mallory's publish: {answer.status_code}"):
                self.count("a tenant's publish: 403")
        self._garbage_commands()

    def _garbage_commands(self) -> None:
        stream = keys.control_stream("tiny")
        for fields in ({"command": "{not json"}, {"junk": "1"}, {"command": json.dumps({"op": "explode"})},
                       {"command": json.dumps({"id": "x" * 65, "op": "weights", "model": "tiny", "issued_at": 0})}):
            self.trainer_conn.xadd(stream, fields)  # type: ignore[arg-type]
        command_id = f"ghost-{uuid.uuid4().hex[:8]}"
        command = {"id": command_id, "op": "weights", "model": "tiny", "issued_at": time.time(),
                   "version": self.version, "policy": "drain", "blob_prefix": f"ghost:{command_id}",
                   "files": [{"name": "model.safetensors", "size": 1 << 20, "sha256": "0" * 64, "chunks": 3}]}
        self.trainer_conn.xadd(stream, {"command": json.dumps(command)})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.trainer_conn.hlen(keys.ack_key(command_id)) < len(TINY_WORKERS):
            time.sleep(0.2)
        acks = {k.decode(): json.loads(v) for k, v in self.trainer_conn.hgetall(keys.ack_key(command_id)).items()}
        if self.check(set(acks) == set(TINY_WORKERS) and not any(a["ok"] for a in acks.values()),
                      f"a command naming missing chunks: {acks}"):
            self.count("garbage control commands survived; missing chunks refused")


# ---------------------------------------------------------------- 5: replay


REPLAYABLE_MS = 120_000  # a result this close to its expiry is replayed and watched no more


class ReplayAttack(Actor):
    """The hostile producer rewrites ended jobs' hashes (its own and, as if it had learnt their ids,
    the good producer's) and pushes them back on a queue, every way it can. Own: the id pushed onto
    another model's queue, and a job's id pushed again while it still runs."""

    attack = "replay"
    pause_s = 0.2

    def __init__(self, stack: Stack, ledger: Ledger) -> None:
        super().__init__(stack, ledger)
        self.hostile = stack.redis_as("hostile")
        self.client = Client(stack.url_as("hostile"))
        self.rng = random.Random(5)
        self.watched: dict[str, bytes] = {}

    def round(self) -> None:
        own = self.client.submit({"model": "tiny", "prompt_token_ids": [9, 9, 9], "max_tokens": 6, "temperature": 0})
        self.ledger.expect(own, self.attack, "finished")
        running = self.client.submit({"model": "fake", "prompt": "twice", "max_tokens": 80})
        self.ledger.expect(running, self.attack, "finished")
        time.sleep(0.3)
        self.ledger.pushed_while_running.add(running)
        self.hostile.rpush("rq:queue:mlxq:fake", running)  # pushed again while it runs: its first result stays
        self.client.wait(own, timeout=120)
        # Ended jobs whose result will outlive the check: once a result expired, its id names no job.
        targets = [j for j in [own, *self.ledger.some_good_jobs(40)[:20]]
                   if self.stack.admin.pttl(keys.result_key(j)) > REPLAYABLE_MS]
        for job_id in self.rng.sample(targets, min(4, len(targets))):
            self.watched.setdefault(job_id, self.stack.admin.get(keys.result_key(job_id)) or b"")
            key = f"rq:job:{job_id}"
            how = self.rng.choice(["rewrite", "delete-and-recreate", "twice", "other-queue"])
            attack = job_data({"prompt_token_ids": [66, 66, 66], "max_tokens": 6})
            if how == "delete-and-recreate":
                self.hostile.delete(key)
            self.hostile.hset(key, mapping={"data": attack, "status": self.rng.choice(["queued", "finished", "bogus"]),
                                            "origin": "mlxq:tiny", "created_at": "2026-11-30T00:00:00.000000Z"})
            queue = "rq:queue:mlxq:fake" if how == "other-queue" else "rq:queue:mlxq:tiny"
            self.hostile.rpush(queue, job_id)
            if how == "twice":
                self.hostile.rpush("rq:queue:mlxq", job_id)
            self.count(f"replays ({how})")
        for job_id, first in list(self.watched.items()):
            now = self.stack.admin.get(keys.result_key(job_id))
            if now is not None:
                self.check(now == first, f"{job_id}: result changed after a replay:\n{first[:300]!r}\n{now[:300]!r}")
            if self.stack.admin.pttl(keys.result_key(job_id)) < REPLAYABLE_MS:
                del self.watched[job_id]


# ---------------------------------------------------------------- 6: scripts


BUSY_LOOP = "local i = 0 while i < tonumber(ARGV[1]) do i = i + 1 end return i"


class ScriptAttack(Actor):
    """`SCRIPT FLUSH`, `FUNCTION FLUSH`, `SCRIPT KILL` and the commands the ACL leaves out, from the
    hostile producer (refused); the `EVAL` it is allowed: writes through a script to keys it may not
    write (refused inside), commands scripts may not call, and busy loops that hold the whole server
    for `busy_s` a time (allowed: every client waits). Own: the script cache lost for real now and then
    (what a failover does), which every client must survive."""

    attack = "scripts"
    pause_s = 0.5

    def __init__(self, stack: Stack, ledger: Ledger, busy_s: float = 0.3) -> None:
        super().__init__(stack, ledger)
        self.hostile = stack.redis_as("hostile")
        self.busy_s = busy_s
        self.iterations = 1_000_000
        self.n = 0

    def round(self) -> None:
        self.n += 1
        h = self.hostile
        denied = {
            "SCRIPT FLUSH": lambda: h.script_flush(), "FUNCTION FLUSH": lambda: h.execute_command("FUNCTION", "FLUSH"),
            "SCRIPT KILL": lambda: h.script_kill(), "SCRIPT LOAD": lambda: h.script_load("return 1"),
            "FLUSHALL": lambda: h.flushall(), "CONFIG SET": lambda: h.config_set("maxmemory", "1"),
            "KEYS": lambda: h.keys("*"), "SCAN": lambda: h.scan(0), "RANDOMKEY": lambda: h.randomkey(),
            "LRANGE queue": lambda: h.lrange("rq:queue:mlxq:tiny", 0, -1),
            "DEL queue": lambda: h.delete("rq:queue:mlxq:tiny"), "LPUSH queue": lambda: h.lpush("rq:queue:mlxq:tiny", "x"),
            "SET result": lambda: h.set(keys.result_key("forged"), "{}"),
            "XADD stream": lambda: h.xadd(keys.stream_key("forged"), {"data": "{}"}),
            "DEBUG SLEEP": lambda: h.execute_command("DEBUG", "SLEEP", "1"),
            "SHUTDOWN": lambda: h.execute_command("SHUTDOWN", "NOSAVE"),
        }
        for what, attempt in denied.items():
            if self.check(refused(attempt), f"{what} was allowed"):
                self.count("commands refused by the ACL")
        for script in ("return redis.call('SET', KEYS[1], 'forged')", "return redis.call('SCRIPT', 'FLUSH')",
                       "return redis.call('KEYS', '*')", "return redis.call('DEL', 'rq:queue:mlxq:tiny')"):
            try:
                h.eval(script, 1, keys.result_key("forged"))
                self.check(False, f"EVAL {script!r} went through")
            except redis.exceptions.ResponseError:
                self.count("EVAL of refused commands refused inside")
        started = time.monotonic()
        h.eval(BUSY_LOOP, 0, self.iterations)
        took = time.monotonic() - started
        self.count("busy loops run (the server held)")
        self.count("busy loop ms", int(took * 1000))
        self.iterations = max(100_000, min(int(self.iterations * self.busy_s / max(took, 1e-3)), 200_000_000))
        if self.n % 10 == 0:
            self.stack.admin.script_flush()
            self.count("script cache lost (admin flush)")


# ---------------------------------------------------------------- 7: keys changed under running jobs


class HijackAttack(Actor):
    """The hostile producer's own running jobs: the hash turned into a list, its status and data
    rewritten, its key expired or renamed away, while the job runs; the stream key turned into a
    string (refused to the producer; done as an admin's broken tool would)."""

    attack = "hijack"
    pause_s = 0.5

    def __init__(self, stack: Stack, ledger: Ledger) -> None:
        super().__init__(stack, ledger)
        self.hostile = stack.redis_as("hostile")
        self.client = Client(stack.url_as("hostile"))

    def round(self) -> None:
        ways = ["list", "rewrite", "expire", "rename", "stream"]
        jobs = {way: self.client.submit({"model": "fake", "prompt": f"hijack {way}", "max_tokens": 120,
                                         "stream": True}) for way in ways}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(self.client.status(j) == "started" for j in jobs.values()):
            time.sleep(0.05)
        for way, job_id in jobs.items():
            key = f"rq:job:{job_id}"
            if way == "list":  # in one transaction: the job may end between two commands and write its hash again
                self.hostile.pipeline(transaction=True).delete(key).rpush(key, "junk").execute()
            elif way == "rewrite":
                self.hostile.hset(key, mapping={"status": "finished", "data": b"\x80garbage", "origin": "nowhere"})
            elif way == "expire":
                self.hostile.expire(key, 1)
            elif way == "rename":
                self.hostile.rename(key, f"rq:job:{job_id}-moved")
            elif way == "stream":
                self.check(refused(lambda: self.hostile.set(keys.stream_key(job_id), "junk")),
                           "the producer could overwrite a stream")
                self.stack.admin.delete(keys.stream_key(job_id))
                self.stack.admin.set(keys.stream_key(job_id), "junk")
            self.ledger.expect(job_id, self.attack, "ended")
            self.count(f"running jobs hijacked ({way})")


# ---------------------------------------------------------------- 8: garbage job hashes


class GarbageAttack(Actor):
    """Job hashes written by hand with broken fields, functions and callbacks off the allowlist,
    data that is not JSON or nests too deep, keys of the wrong type; ids that identify nothing. Own:
    a request for one model planted on another model's queue, and token ids outside the vocabulary."""

    attack = "garbage"
    pause_s = 0.3

    def __init__(self, stack: Stack, ledger: Ledger) -> None:
        super().__init__(stack, ledger)
        self.hostile = stack.redis_as("hostile")
        self.n = 0

    def round(self) -> None:
        self.n += 1
        queue = ("mlxq:tiny", "mlxq:fake", "mlxq")[self.n % 3]
        cases: dict[str, tuple[Optional[dict[str, object]], str, Optional[str]]] = {
            "created": (job_fields(queue=queue, created_at="yesterday"), "failed", "created_at"),
            "timeout": (job_fields(queue=queue, timeout="abc"), "failed", "timeout"),
            "ttl": (job_fields(queue=queue, result_ttl="forever"), "failed", "result_ttl"),
            "status": (job_fields(queue=queue, status="exploded"), "failed", "status"),
            "no-data": (job_fields(queue=queue, data=None), "failed", "data"),
            "not-json": (job_fields(queue=queue, data=b"\x80\x81 pickle?"), "failed", "not valid JSON"),
            "deep": (job_fields(queue=queue, data=b"[" * 50_000 + b"]" * 50_000), "failed", "nested too deeply"),
            "bomb": (job_fields(queue=queue, data=zlib.compress(b" " * (32 * 1024 * 1024))), "failed", "data"),
            "function": (job_fields(queue=queue, data=job_data({"prompt": "x"}, "os.abort")), "failed",
                         "FunctionNotAllowed"),
            "callback": (job_fields(queue=queue, failure_callback_name="os.abort",
                                    success_callback_name="os.abort"), "failed", "CallbackNotAllowed"),
            "hopeless": (job_fields({"prompt": "x", "max_tokens": 0}, queue=queue), "failed", "max_tokens"),
            "other-model": (job_fields({"model": "fake", "prompt_token_ids": [5, 6], "max_tokens": 4}, queue="mlxq:tiny"),
                            "ended", None),
            "vocab": (job_fields({"prompt_token_ids": [5, 10**9], "max_tokens": 4}, queue="mlxq:tiny"), "failed",
                      "prompt_token_ids"),
        }
        for case, (fields, kind, needle) in cases.items():
            job_id = f"garbage-{self.n}-{case}"
            target = "mlxq:tiny" if case in ("other-model", "vocab") else queue
            plant(self.hostile, job_id, fields, target)
            self.ledger.expect(job_id, self.attack, kind, needle)
        self.hostile.set(f"rq:job:garbage-{self.n}-string", "junk")
        plant(self.hostile, f"garbage-{self.n}-string", None, queue)
        self.ledger.expect(f"garbage-{self.n}-string", self.attack, "failed", "not a hash")
        for raw in (b"\xff\xfe\xfd", b"", b"x" * 2000):
            self.hostile.rpush(f"rq:queue:{queue}", raw)
        self.count("garbage hashes planted", len(cases) + 1)
        self.count("entries that identify nothing", 3)


# ---------------------------------------------------------------- 9: slow clients


class SlowClientAttack(Actor):
    """Connections that send nothing, a header a byte at a time, a body never finished, a body a
    byte at a time; each cut off by the gateway's deadlines. Own: twenty silent connections at once
    (slowloris) while the good traffic goes on."""

    attack = "slow-clients"
    pause_s = 0.5
    HEADER_S, BODY_S = 2.0, 3.0  # tests/attack_stack.py GATEWAY_ENV

    def round(self) -> None:
        address = gateway_address(self.stack)
        clients = {f"silent-{i}": socket.create_connection(address) for i in range(20)}
        clients["trickle-head"] = socket.create_connection(address)
        clients["no-body"] = socket.create_connection(address)
        clients["trickle-body"] = socket.create_connection(address)
        clients["trickle-head"].sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
        head = b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        clients["no-body"].sendall(head + b'{"prompt":')
        clients["trickle-body"].sendall(head)
        received = {name: b"" for name in clients}
        closed: dict[str, float] = {}
        started = time.monotonic()
        last_trickle = 0.0
        try:
            while len(closed) < len(clients) and time.monotonic() - started < 20:
                if time.monotonic() - last_trickle > 0.3:
                    last_trickle = time.monotonic()
                    for name, payload in (("trickle-head", b"X"), ("trickle-body", b" ")):
                        if name not in closed:
                            try:
                                clients[name].sendall(payload)
                            except OSError:
                                closed[name] = time.monotonic() - started
                open_socks = [s for n, s in clients.items() if n not in closed]
                readable, _, _ = select.select(open_socks, [], [], 0.1)
                for sock in readable:
                    name = next(n for n, s in clients.items() if s is sock)
                    try:
                        data = sock.recv(4096)
                    except OSError:
                        data = b""
                    if data:
                        received[name] += data
                    else:
                        closed[name] = time.monotonic() - started
        finally:
            for sock in clients.values():
                sock.close()
        for name in clients:
            limit = self.BODY_S if "body" in name else self.HEADER_S
            when = closed.get(name)
            if self.check(when is not None and when < limit + 8, f"{name} not cut off ({when})"):
                self.count("slow connections cut off")
            if name.startswith(("silent", "trickle-head")):
                self.check(received[name].startswith(b"HTTP/1.1 408"), f"{name}: {received[name][:100]!r}")


# ---------------------------------------------------------------- 10: strict types


STRICT = [("logprobs", "yes"), ("stream", "true"), ("max_tokens", "5"), ("temperature", "0.5"), ("n", 1.0),
          ("ignore_eos", 1), ("top_logprobs", "2"), ("seed", "7"), ("top_k", 2.5), ("max_tokens", 10**30),
          ("temperature", [0.5]), ("stop", 5)]
RAW_BODIES = [  # bodies no JSON library writes: refused, never a 500
    b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": Infinity}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1e400}',
    b"[" * 100_000 + b"]" * 100_000,
    b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
    b'["model", "tiny"]',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "max_tokens": "4"}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}]',
]


class StrictTypeAttack(Actor):
    """A string where a boolean or a number goes (and a float where an integer does) on chat and jobs:
    400 naming the field. Own: bodies with NaN, Infinity, 1e400, nesting 100,000 deep, bytes that are
    not UTF-8, a duplicated key, a cut-off body: 400, never a 500."""

    attack = "strict-types"
    pause_s = 0.3

    def round(self) -> None:
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        job = {"model": "tiny", "prompt": "x", "max_tokens": 2}
        with self.stack.http("mallory") as http:
            for field, value in STRICT:
                for path, body in (("/chat/completions", chat), ("/jobs", job)):
                    answer = http.post(path, json={**body, field: value})
                    if self.check(answer.status_code == 400 and (error_param(answer) or "").split(".")[0] == field,
                                  f"{path} {field}={value!r}: {answer.status_code} {answer.text[:300]}"):
                        self.count("wrong types refused (400, named)")
            for raw in RAW_BODIES:
                for path in ("/chat/completions", "/jobs"):
                    answer = http.post(path, content=raw, headers={"Content-Type": "application/json"})
                    if self.check(answer.status_code == 400 and "error" in answer.json(),
                                  f"{path} {raw[:60]!r}: {answer.status_code} {answer.text[:300]}"):
                        self.count("bodies no JSON library writes refused (400)")


def classes(stack: Stack, ledger: Ledger, broken: dict[str, Path], bad_adapters: dict[str, Path],
            busy_s: float) -> list[Actor]:
    return [StreamAttack(stack, ledger), ConstraintAttack(stack, ledger), LogprobAttack(stack, ledger),
            WeightAttack(stack, ledger, broken, bad_adapters), ReplayAttack(stack, ledger),
            ScriptAttack(stack, ledger, busy_s), HijackAttack(stack, ledger), GarbageAttack(stack, ledger),
            SlowClientAttack(stack, ledger), StrictTypeAttack(stack, ledger)]

