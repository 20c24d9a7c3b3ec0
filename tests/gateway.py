"""The gateway for tests: served in-process by uvicorn on a free port, with the official `openai` client
pointed at it; waits for a worker's heartbeat entry, and entries written by hand for models no worker
process serves."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
import uvicorn

from mlxq.redis_server import free_port
from producer.api.app import create_app
from producer.api.http_deadlines import uvicorn_options
from producer.api.settings import GatewaySettings
from schemas import keys
from schemas.presence import WorkerPresence


def key_entry(tenant: str, key: str) -> str:
    """The MLXQ_API_KEYS entry of a key: never the key itself."""
    return f"{tenant}:{hashlib.sha256(key.encode()).hexdigest()}"


@contextmanager
def running_gateway(redis_url: str, **settings: Any) -> Iterator[str]:
    """Serve a gateway on a free port for the block; yields its base URL (`http://127.0.0.1:P/v1`)."""
    # Open streams are cut after 5 s at the end of the block: a server left running keeps its upkeep tasks
    # (the queue-registry pruner among them) working on a Redis later tests share.
    config = GatewaySettings(redis_url=redis_url, **{"shutdown_grace_s": 5, **settings})
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(config), host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="on", timeout_graceful_shutdown=config.shutdown_grace_s,
                                           **uvicorn_options()))
    thread = threading.Thread(target=server.run, name="gateway", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the gateway did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=20)
        if thread.is_alive():
            raise AssertionError("the test gateway did not stop within 20 s of its block's end")


def wait_live(conn: redis.Redis, name: str, timeout: float = 60) -> None:
    """Until the worker `name` has written its heartbeat entry (it does once its model is loaded)."""
    deadline = time.monotonic() + timeout
    while not conn.exists(keys.worker_key(name)):
        if time.monotonic() > deadline:
            raise AssertionError(f"worker {name} wrote no heartbeat entry in {timeout} s")
        time.sleep(0.05)


def announce(conn: redis.Redis, name: str, alias: str, queues: list[str] | None = None, ttl: int = 600) -> None:
    """Write a heartbeat entry as a worker does (schemas/presence.py), for a worker that does not exist."""
    now = time.time()
    presence = WorkerPresence(name=name, alias=alias, kind="fake", queues=queues or [keys.queue_for_model(alias), "mlxq"],
                              started_at=now, heartbeat_at=now, ttl_s=ttl, max_num_seqs=32)
    conn.set(keys.worker_key(name), presence.model_dump_json(), ex=ttl)
    conn.zadd(keys.WORKERS_KEY, {name: now})
