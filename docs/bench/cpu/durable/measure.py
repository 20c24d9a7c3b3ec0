"""The cost of `durable=True` per job: a primary and one replica on loopback (private redis-servers), N jobs
submitted one by one (`Client.submit`) and in batches of 100 (`submit_many`), with and without waiting for the
replica; then the worker side: a fake-engine worker finishing N jobs with MLXQ_DURABLE_RESULTS=0 and 1.
Run: PYTHONPATH=. python docs/bench/cpu/durable/measure.py [N]  (prints one JSON object)."""

from __future__ import annotations

import json
import statistics
import sys
import time

import redis

from mlxq.redis_server import RedisServer
from producer import Client
from tests.workers import start_fake_worker, stop, wait_for

N = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
REQUEST = {"prompt_token_ids": [1, 2, 3], "max_tokens": 1}


def submits(client: Client, durable: bool) -> float:
    started = time.perf_counter()
    for _ in range(N):
        client.submit(REQUEST, durable=durable)
    return (time.perf_counter() - started) / N * 1e6


def batches(client: Client, durable: bool) -> float:
    started = time.perf_counter()
    for _ in range(N // 100):
        client.submit_many([REQUEST] * 100, durable=durable)
    return (time.perf_counter() - started) / N * 1e6


def worker_run(url: str, durable: int) -> float:
    client = Client(url)
    ids = client.submit_many([REQUEST] * N)
    worker = start_fake_worker(url, name=f"bench-{durable}", step_delay_s=0.0,
                               env={"MLXQ_DURABLE_RESULTS": str(durable)})
    try:
        wait_for(lambda: client.status(ids[0]) != "queued", timeout=60, what="the worker to start")
        started = time.perf_counter()
        client.wait_many(ids, timeout=600)
        return (time.perf_counter() - started) / N * 1e6
    finally:
        stop(worker)
        client.connection.flushall()
        client.close()


def main() -> None:
    with RedisServer(extra_args=["--repl-diskless-sync-delay", "0"]) as primary, \
            RedisServer(extra_args=["--replicaof", "127.0.0.1", str(primary.port)]) as replica:
        link = redis.Redis(port=replica.port)
        while link.info("replication")["master_link_status"] != "up":
            time.sleep(0.05)
        client = Client(primary.url)
        rows: dict[str, list[float]] = {}
        for _ in range(3):  # interleaved, so a busy moment on the shared machine hits both sides
            for name, fn, durable in (("submit_us", submits, False), ("submit_durable_us", submits, True),
                                      ("submit_many_us", batches, False), ("submit_many_durable_us", batches, True)):
                rows.setdefault(name, []).append(fn(client, durable))
                client.connection.flushall()
        for _ in range(2):
            for durable in (0, 1):
                rows.setdefault(f"worker_durable_{durable}_us", []).append(worker_run(primary.url, durable))
        print(json.dumps({"jobs": N, **{k: round(statistics.median(v), 1) for k, v in rows.items()},
                          "runs": {k: [round(x, 1) for x in v] for k, v in rows.items()}}, indent=1))


if __name__ == "__main__":
    main()
