"""The cost of `durable=True` per job: a primary and one replica on loopback (private redis-servers), N jobs
submitted one by one (`Client.submit`) and in batches of 100 (`submit_many`), with and without waiting for the
replica; then the worker side: a fake-engine worker finishing N jobs with MLXQ_DURABLE_RESULTS=0 and 1.
Run: PYTHONPATH=. python docs/bench/cpu/durable/measure.py [N]  (prints one JSON object)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import redis

from mlxq.redis_server import RedisServer
from producer import Client
from tests.workers import stop, wait_for

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
    """Wall time per job, submit to result, through one zero-cost worker (mlxq.bench.fake_worker) started first."""
    client = Client(url)
    worker = subprocess.Popen([sys.executable, "-m", "mlxq.bench.fake_worker", "--url", url, "--name",
                               f"bench-{durable}", "--max-num-seqs", "256", "--durable-results", str(durable), "mlxq"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: client.connection.exists(f"mlxq:worker:bench-{durable}"), timeout=60,
                 what="the worker to start")
        started = time.perf_counter()
        ids = client.submit_many([{**REQUEST, "prompt_token_ids": [1 + i % 250, 2, 3]} for i in range(N)])
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
