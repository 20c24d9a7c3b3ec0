"""The gateway's scenarios: what one `mlxq api` process costs next to the producer.

- gateway-stream: `--gateway-clients` (256) streaming chat requests at once, through one gateway process
  (clients reading its SSE, mlxq/bench/rawhttp.py), against the same requests submitted and streamed with the producer
  (`AsyncClient.stream`), on the bench's model: tokens/s and p50 TTFT of each, and their ratios. The two
  arms run side by side, alternating which goes first, `--repeats` times.
- gateway-blocking: one gateway process in front of a zero-cost fake-engine worker, `--gateway-clients`
  closed-loop clients sending blocking one-token chat requests, `--gateway-requests` in all: requests/s,
  latency, and the CPU seconds each process spent; beside it the same jobs through the producer.

Both run client, gateway, worker and Redis on one machine. The workers' heartbeat entries (what the
gateway routes by) are written here, as a worker writes its own (schemas/presence.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any, Callable, Optional

import redis

from mlxq.bench.arm_mlxq import MlxqCluster
from mlxq.bench.config import BenchConfig
from mlxq.bench.procs import ProcessSet, wait_http_ok
from mlxq.bench.rawhttp import RawConnection
from mlxq.bench.stats import distribution, median, ratio
from mlxq.bench.workloads import Tokenizer, make_prompts
from mlxq.redis_server import free_port
from producer import AsyncClient
from schemas import keys
from schemas.presence import WorkerPresence

__all__ = ["gateway_blocking", "gateway_stream", "blocking_line", "stream_line"]

ALIAS = "bench-model"
FAKE_ALIAS = "fake"
PRESENCE_TTL_S = 24 * 3600


def announce(url: str, name: str, alias: str, queues: list[str]) -> None:
    now = time.time()
    presence = WorkerPresence(name=name, alias=alias, queues=queues, started_at=now, heartbeat_at=now,
                              ttl_s=PRESENCE_TTL_S)
    conn = redis.Redis.from_url(url)
    conn.set(keys.worker_key(name), presence.model_dump_json(), ex=PRESENCE_TTL_S)
    conn.zadd(keys.WORKERS_KEY, {name: now})
    conn.close()


def start_gateway(url: str, procs: ProcessSet) -> tuple[Any, str]:
    port = free_port()
    proc = procs.start("gateway", [sys.executable, "-m", "mlxq", "api", "--url", url, "--port", str(port),
                                   "--log-level", "warning"],
                       env={"MLXQ_API_MAX_QUEUE_DEPTH": "0", "MLXQ_API_TENANT_MAX_IN_FLIGHT": "100000"})
    wait_http_ok("127.0.0.1", port, "/v1/models", proc, timeout=60)
    return proc, f"http://127.0.0.1:{port}/v1"


def cpu_seconds(pid: int) -> float:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


# ---------------------------------------------------------------- streaming


def _chat(prompt_text: str, max_tokens: int) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": prompt_text}], "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}


async def _producer_streams(url: str, bodies: list[dict[str, Any]], queue: str, timeout: float) -> list[dict[str, Any]]:
    async with AsyncClient(url) as client:
        t0 = time.perf_counter()

        async def one(body: dict[str, Any]) -> dict[str, Any]:
            sent = time.perf_counter()
            job_id = await client.submit({**body, "model": ALIAS}, queue=queue, timeout=3600)
            first, tokens = None, 0
            async for event in client.stream(job_id, timeout=timeout):
                if event["event"] == "token" and event["token_ids"]:
                    first = first or time.perf_counter()
                    tokens += len(event["token_ids"])
            return {"sent": sent - t0, "first": (first or sent) - sent, "end": time.perf_counter() - t0, "tokens": tokens}

        return list(await asyncio.gather(*(one(b) for b in bodies)))


async def _gateway_streams(base: str, bodies: list[dict[str, Any]], timeout: float) -> list[dict[str, Any]]:
    t0 = time.perf_counter()

    async def one(body: dict[str, Any]) -> dict[str, Any]:
        connection = RawConnection(base)
        sent = time.perf_counter()
        first, tokens = None, 0
        try:
            async for data in connection.stream("/chat/completions", {**body, "model": ALIAS, "return_token_ids": True}):
                for choice in json.loads(data).get("choices", ()):
                    if choice.get("token_ids"):
                        first = first or time.perf_counter()
                        tokens += len(choice["token_ids"])
        finally:
            await connection.close()
        return {"sent": sent - t0, "first": (first or sent) - sent, "end": time.perf_counter() - t0, "tokens": tokens}

    return list(await asyncio.wait_for(asyncio.gather(*(one(b) for b in bodies)), timeout))


def _stream_summary(records: list[dict[str, Any]], expected: int) -> dict[str, Any]:
    wall = max(r["end"] for r in records) - min(r["sent"] for r in records)
    tokens = sum(r["tokens"] for r in records)
    return {"requests": len(records), "complete": sum(1 for r in records if r["tokens"] == expected),
            "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall if wall > 0 else None,
            "ttft_s": distribution([r["first"] for r in records])}


def gateway_stream(cfg: BenchConfig, tokenizer: Tokenizer, make_cluster: Callable[..., MlxqCluster], url: str,
                   procs: ProcessSet) -> dict[str, Any]:
    clients = cfg.gateway_clients
    queue = keys.queue_for_model(ALIAS)
    cluster = make_cluster(1, clients)
    cluster.worker_argv = lambda name, queues: [
        sys.executable, "-m", "mlxq", "worker", "--url", url, "--model", cluster.model, "--alias", ALIAS,
        "--name", name, "--log-level", "WARNING", *queues, queue]
    prompts = make_prompts(tokenizer, clients * (cfg.repeats * 2 + 1), cfg.prompt_tokens, seed=cfg.seed,
                           salt="gateway")
    cluster.start()
    announce(url, cluster.names[0], ALIAS, [queue])
    gateway, base = start_gateway(url, procs)
    runs: list[dict[str, Any]] = []
    try:
        warm = [_chat(p.text, cfg.warmup_tokens) for p in prompts[:clients]]
        asyncio.run(_producer_streams(url, warm, queue, cfg.request_timeout_s))
        for repeat in range(cfg.repeats):
            order = ("producer", "gateway") if repeat % 2 == 0 else ("gateway", "producer")
            measured: dict[str, Any] = {"repeat": repeat, "order": list(order)}
            for i, arm in enumerate(order):
                chunk = prompts[clients * (1 + 2 * repeat + i): clients * (2 + 2 * repeat + i)]
                bodies = [_chat(p.text, cfg.new_tokens) for p in chunk]
                gateway_cpu = cpu_seconds(gateway.pid)
                records = (asyncio.run(_producer_streams(url, bodies, queue, cfg.request_timeout_s)) if arm == "producer"
                           else asyncio.run(_gateway_streams(base, bodies, cfg.request_timeout_s)))
                measured[arm] = _stream_summary(records, cfg.new_tokens)
                measured[arm]["gateway_cpu_s"] = cpu_seconds(gateway.pid) - gateway_cpu
            measured["tokens_per_s_ratio"] = ratio(measured["gateway"]["tokens_per_s"], measured["producer"]["tokens_per_s"])
            measured["ttft_p50_ratio"] = ratio((measured["gateway"]["ttft_s"] or {}).get("p50"),
                                               (measured["producer"]["ttft_s"] or {}).get("p50"))
            runs.append(measured)
            print(f"  gateway-stream #{repeat + 1}: tokens/s ratio {measured['tokens_per_s_ratio']:.3f}, "
                  f"p50 TTFT ratio {measured['ttft_p50_ratio']:.3f}", flush=True)
    finally:
        procs.stop(gateway)
        cluster.stop()
    return {"clients": clients, "prompt_tokens": cfg.prompt_tokens, "new_tokens": cfg.new_tokens, "runs": runs,
            "tokens_per_s_ratio": median([r["tokens_per_s_ratio"] for r in runs]),
            "ttft_p50_ratio": median([r["ttft_p50_ratio"] for r in runs])}


# ---------------------------------------------------------------- blocking


async def _closed_loop(total: int, concurrency: int, send: Callable[[int], Any]) -> tuple[float, list[float], int]:
    """`concurrency` workers sending `total` requests in all; (wall s, latencies, failures)."""
    latencies: list[float] = []
    failures = 0
    counter = iter(range(total))

    async def worker() -> None:
        nonlocal failures
        for i in counter:
            start = time.perf_counter()
            try:
                await send(i)
                latencies.append(time.perf_counter() - start)
            except Exception:
                failures += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - start, latencies, failures


async def _producer_blocking(url: str, total: int, concurrency: int) -> tuple[float, list[float], int]:
    async with AsyncClient(url) as client:
        async def send(i: int) -> None:
            job_id = await client.submit({"model": FAKE_ALIAS, "messages": [{"role": "user", "content": f"hi {i}"}],
                                          "max_tokens": 1})
            result = await client.wait(job_id, timeout=60)
            if result.status != "finished":
                raise RuntimeError(result.status)

        return await _closed_loop(total, concurrency, send)


async def _gateway_blocking(base: str, total: int, concurrency: int) -> tuple[float, list[float], int]:
    connections = [RawConnection(base) for _ in range(concurrency)]
    free = asyncio.Queue[RawConnection]()
    for connection in connections:
        free.put_nowait(connection)

    async def send(i: int) -> None:
        connection = await free.get()
        try:
            await connection.post("/chat/completions", {
                "model": FAKE_ALIAS, "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 1})
        except BaseException:
            await connection.close()  # a broken exchange leaves the connection unusable; it reopens
            raise
        finally:
            free.put_nowait(connection)

    try:
        return await _closed_loop(total, concurrency, send)
    finally:
        for connection in connections:
            await connection.close()


def _blocking_summary(wall: float, latencies: list[float], failures: int, cpu: dict[str, float]) -> dict[str, Any]:
    done = len(latencies)
    return {"completed": done, "failed": failures, "wall_s": wall, "requests_per_s": done / wall if wall else None,
            "latency_s": distribution(latencies), "cpu_s": cpu,
            "cpu_ms_per_request": {name: 1000 * s / done for name, s in cpu.items()} if done else None}


def gateway_blocking(cfg: BenchConfig, url: str, procs: ProcessSet) -> dict[str, Any]:
    worker = procs.start("fake-worker", [sys.executable, "-m", "mlxq", "worker", "--url", url, "--model", FAKE_ALIAS,
                                         "--name", "bench-fake", "--max-num-seqs", "256", "--log-level", "WARNING"],
                         env={"MLXQ_ENGINE": "fake", "MLXQ_FAKE_STEP_DELAY_S": "0"})
    announce(url, "bench-fake", FAKE_ALIAS, [keys.queue_for_model(FAKE_ALIAS), keys.DEFAULT_QUEUE])
    gateway, base = start_gateway(url, procs)
    concurrency, total = cfg.gateway_clients, cfg.gateway_requests
    runs: list[dict[str, Any]] = []
    pids = {"gateway": gateway.pid, "worker": worker.pid, "client": os.getpid()}
    try:
        asyncio.run(_gateway_blocking(base, min(total, 200), concurrency))  # warm-up
        for repeat in range(cfg.repeats):
            measured: dict[str, Any] = {"repeat": repeat}
            order = ("gateway", "producer") if repeat % 2 == 0 else ("producer", "gateway")
            for arm in order:
                before = {name: cpu_seconds(pid) for name, pid in pids.items()}
                outcome = (asyncio.run(_gateway_blocking(base, total, concurrency)) if arm == "gateway"
                           else asyncio.run(_producer_blocking(url, total, concurrency)))
                cpu = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
                measured[arm] = _blocking_summary(*outcome, cpu)
            measured["requests_per_s_ratio"] = ratio(measured["gateway"]["requests_per_s"],
                                                     measured["producer"]["requests_per_s"])
            runs.append(measured)
            print(f"  gateway-blocking #{repeat + 1}: gateway {measured['gateway']['requests_per_s']:.0f} req/s, "
                  f"producer {measured['producer']['requests_per_s']:.0f} jobs/s", flush=True)
    finally:
        procs.stop(gateway)
        procs.stop(worker)
    gateway_runs = [r["gateway"] for r in runs]
    return {"clients": concurrency, "requests": total, "runs": runs,
            "requests_per_s": median([r["requests_per_s"] for r in gateway_runs]),
            "producer_jobs_per_s": median([r["producer"]["requests_per_s"] for r in runs]),
            "gateway_cpu_ms_per_request": median([(r["cpu_ms_per_request"] or {}).get("gateway") for r in gateway_runs])}


# ---------------------------------------------------------------- report lines


def _num(value: Optional[float], digits: int = 0) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def stream_line(s: dict[str, Any]) -> str:
    last = s["runs"][-1] if s["runs"] else {}
    return (f"- gateway streams ({s['clients']} streaming chat clients, {s['new_tokens']} new tokens): through one "
            f"gateway process / through the producer, tokens/s {_num(s['tokens_per_s_ratio'], 3)}x, p50 TTFT "
            f"{_num(s['ttft_p50_ratio'], 3)}x (medians of {len(s['runs'])}; last: "
            f"{_num(last.get('gateway', {}).get('tokens_per_s'))} vs {_num(last.get('producer', {}).get('tokens_per_s'))} tok/s)")


def blocking_line(s: dict[str, Any]) -> str:
    return (f"- gateway blocking ({s['clients']} clients, fake engine): {_num(s['requests_per_s'])} requests/s through "
            f"one gateway process ({_num(s['gateway_cpu_ms_per_request'], 2)} ms of its CPU per request); "
            f"the same jobs through the producer {_num(s['producer_jobs_per_s'])} jobs/s")
