"""The processes the tenant-attack suite runs against: one redis-server (the session's), a gateway
process (`mlxq api`) with two tenants and an admin, worker processes on the tiny model and one on the
fake engine, each under the documented worker ACL; Redis users for a producer, a hostile producer and
a trainer, each under its documented ACL; and what the suite reads off them at the end (every result
key's writes, each process's RSS and log)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional

import httpx
import redis

from mlxq.redis_server import free_port
from schemas import keys
from tests.gateway import key_entry
from tests.test_security import PRODUCER_ACL, WORKER_ACL

TENANT_KEYS = {"acme": "sk-acme-attack", "mallory": "sk-mallory-attack", "ops": "sk-ops-attack"}
ADMIN_TENANT = "ops"
# A trainer's rights as docs/rl.md lists them: the producer's, and the control plane's keys.
TRAINER_ACL = PRODUCER_ACL.replace("producer on >producer-secret", "trainer on >trainer-secret").replace(
    "%R~rq:results:*", "~mlxq:control:* ~mlxq:paused:* ~mlxq:blob:* ~mlxq:weights:* ~mlxq:adapters:* "
                       "%R~mlxq:ack:* %R~mlxq:workers %R~mlxq:worker:* %R~rq:results:*")
# Short deadlines for slow clients, so the suite sees them cut off within its run.
GATEWAY_ENV = {"MLXQ_API_HEADER_TIMEOUT_S": "2", "MLXQ_API_BODY_TIMEOUT_S": "3"}
TINY_WORKERS = ("tiny-1", "tiny-2")
FAKE_WORKER = "fake-1"


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


class Process:
    """A child process whose output is read as it comes (an unread pipe would block it)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **env})
        self.lines: list[str] = []
        assert self.proc.stdout is not None
        stream = self.proc.stdout
        self._reader = threading.Thread(target=lambda: self.lines.extend(iter(stream.readline, "")),
                                        name=f"log-{name}", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def tail(self, chars: int = 4000) -> str:
        return f"--- {self.name} ---\n{self.log[-chars:]}"

    def stop(self, timeout: float = 60) -> Optional[int]:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(10)  # SIGUSR1: a worker prints its threads' stacks
            time.sleep(1)
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=10)
        return self.proc.returncode


def add_user(admin: redis.Redis, rule: str) -> tuple[str, str]:
    name, *rules = rule.split()
    password = next(r for r in rules if r.startswith(">")).removeprefix(">")
    admin.execute_command("ACL", "SETUSER", name, "reset", *rules)
    return name, password


def connect(port: int, user: str, password: str) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=port, username=user, password=password)


def summary(raw: bytes) -> dict[str, Any]:
    """What the suite checks of a result, kept small: its status, error, choices' ends, and a digest."""
    result = json.loads(raw)
    return {"status": result["status"], "error": result.get("error"),
            "choices": [{"finish_reason": c.get("finish_reason"), "constraint_complete": c.get("constraint_complete")}
                        for c in result.get("choices") or []],
            "digest": hashlib.sha256(raw).hexdigest()}


class ResultWrites(threading.Thread):
    """Every write of a `mlxq:result:*` key, from the server's keyspace notifications, and each key's
    first value as it was written (a long run outlives the keys' TTL): a key written twice is a job
    whose result was replaced (run again, or forged)."""

    def __init__(self, admin: redis.Redis) -> None:
        super().__init__(name="result-writes", daemon=True)
        admin.config_set("notify-keyspace-events", "K$gx")  # string writes, DEL, expiry
        self._reader = redis.Redis(connection_pool=admin.connection_pool)
        self._pubsub = admin.pubsub(ignore_subscribe_messages=True)
        self._pubsub.psubscribe(f"__keyspace@0__:{keys.PREFIX}result:*")
        self.writes: dict[str, list[str]] = {}
        self.first: dict[str, dict[str, Any]] = {}
        self.stopping = threading.Event()
        self._lock = threading.Lock()

    def run(self) -> None:
        prefix = len(f"__keyspace@0__:{keys.PREFIX}result:")
        while not self.stopping.is_set():
            message = self._pubsub.get_message(timeout=0.2)
            if message is None:
                continue
            job_id, event = message["channel"].decode(errors="replace")[prefix:], message["data"].decode()
            raw = self._reader.get(keys.result_key(job_id)) if event == "set" and job_id not in self.first else None
            with self._lock:
                self.writes.setdefault(job_id, []).append(event)
                if raw is not None:
                    self.first[job_id] = summary(raw)

    def first_result(self, job_id: str) -> Optional[dict[str, Any]]:
        with self._lock:
            return self.first.get(job_id)

    def expired_between(self, job_id: str) -> bool:
        """Whether the key expired or was deleted after it was first written (its id then named no job)."""
        events = self.events(job_id)
        return "set" in events and any(e in ("expired", "del", "evicted") for e in events[events.index("set"):])

    def events(self, job_id: str) -> list[str]:
        with self._lock:
            return list(self.writes.get(job_id, []))

    def rewritten(self) -> dict[str, list[str]]:
        """Keys set more than once with no deletion or expiry between (SET ... EX also says `expire`)."""
        found = {}
        with self._lock:
            for job_id, events in self.writes.items():
                sets = 0
                for event in events:
                    sets = 0 if event in ("del", "expired", "evicted") else sets + (event == "set")
                    if sets > 1:
                        found[job_id] = list(events)
                        break
        return found

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=10)
        self._pubsub.close()


@dataclass
class Stack:
    redis_url: str
    port: int
    admin: redis.Redis
    base: str  # the gateway's /v1 URL
    gateway: Process
    workers: dict[str, Process]
    users: dict[str, tuple[str, str]]  # role -> (user, password)
    started_at: dict[str, float] = field(default_factory=dict)  # worker -> its presence's started_at

    def headers(self, tenant: str, **more: Any) -> dict[str, Any]:
        return {"Authorization": f"Bearer {TENANT_KEYS[tenant]}", **more}

    def http(self, tenant: str, timeout: float = 120) -> httpx.Client:
        return httpx.Client(base_url=self.base, headers=self.headers(tenant), timeout=timeout)

    def redis_as(self, role: str) -> redis.Redis:
        return connect(self.port, *self.users[role])

    def url_as(self, role: str) -> str:
        user, password = self.users[role]
        return f"redis://{user}:{password}@127.0.0.1:{self.port}/0"

    def result(self, job_id: str) -> Optional[dict[str, Any]]:
        raw = self.admin.get(keys.result_key(job_id))
        return json.loads(raw) if raw else None

    def processes(self) -> dict[str, Process]:
        return {"gateway": self.gateway, **self.workers}

    def rss(self) -> dict[str, int]:
        return {name: rss_kb(p.pid) for name, p in self.processes().items() if p.alive}

    def presence_started(self) -> dict[str, float]:
        found = {}
        for name in self.workers:
            raw = self.admin.get(keys.worker_key(name))
            if raw:
                found[name] = json.loads(raw)["started_at"]
        return found

    def logs(self) -> str:
        return "\n".join(p.tail() for p in self.processes().values())


def _wait(predicate: Any, timeout: float, what: str, procs: dict[str, Process]) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        dead = [p for p in procs.values() if not p.alive]
        if dead or time.monotonic() > deadline:
            raise AssertionError(f"{what}: " + ("died" if dead else "timed out") + "\n"
                                 + "\n".join(p.tail() for p in procs.values()))
        time.sleep(0.1)


@contextmanager
def running_stack(redis_url: str, tiny_model_dir: str) -> Iterator[Stack]:
    admin = redis.Redis.from_url(redis_url)
    port = admin.connection_pool.connection_kwargs["port"]
    users = {role: add_user(admin, rule) for role, rule in
             (("producer", PRODUCER_ACL), ("worker", WORKER_ACL), ("trainer", TRAINER_ACL))}
    # The hostile producer holds the same documented rights as the good one, as its own user.
    users["hostile"] = add_user(admin, PRODUCER_ACL.replace("producer on >producer-secret",
                                                            "hostile on >hostile-secret"))
    worker_user, worker_password = users["worker"]
    worker_url = f"redis://{worker_user}:{worker_password}@127.0.0.1:{port}/0"
    worker_env = {"MLXQ_REDIS_URL": worker_url, "MLXQ_HEARTBEAT_INTERVAL_S": "1", "MLXQ_SWEEP_INTERVAL_S": "2"}
    workers = {name: Process(name, [sys.executable, "-m", "mlxq", "worker", "--model", tiny_model_dir, "--alias",
                                    "tiny", "--name", name, "--prefix-cache-mb", "64"], worker_env)
               for name in TINY_WORKERS}
    workers[FAKE_WORKER] = Process(FAKE_WORKER, [sys.executable, "-m", "mlxq", "worker", "--model", "fake", "--name",
                                                 FAKE_WORKER],
                                   {**worker_env, "MLXQ_ENGINE": "fake", "MLXQ_FAKE_STEP_DELAY_S": "0.02"})
    gateway_port = free_port()
    gateway = Process("gateway", [sys.executable, "-m", "mlxq", "api", "--port", str(gateway_port), "--log-level",
                                  "warning"],
                      {"MLXQ_REDIS_URL": redis_url, "MLXQ_API_ADMIN_TENANTS": ADMIN_TENANT,
                       "MLXQ_API_KEYS": ",".join(key_entry(t, k) for t, k in TENANT_KEYS.items()), **GATEWAY_ENV})
    stack = Stack(redis_url, port, admin, f"http://127.0.0.1:{gateway_port}/v1", gateway, workers, users)
    try:
        _wait(lambda: all(admin.exists(keys.worker_key(n)) for n in workers), 180, "workers live", workers)
        _wait(lambda: _gateway_answers(stack), 60, "the gateway listening", {"gateway": gateway})
        stack.started_at = stack.presence_started()
        yield stack
    finally:
        for process in stack.processes().values():
            process.stop()
        for user, _ in users.values():
            admin.execute_command("ACL", "DELUSER", user)
        admin.config_set("notify-keyspace-events", "")


def _gateway_answers(stack: Stack) -> bool:
    try:
        models = httpx.get(f"{stack.base}/models", headers=stack.headers("acme"), timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return False
    return {"tiny", "fake"} <= {m["id"] for m in models.get("data", [])}
