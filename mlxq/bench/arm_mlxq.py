"""Arm C: mlxq end to end. The harness is the producer (`producer.Client.submit_many`), a Redis
server is the broker, 1..W `mlxq worker` processes do the work, and the harness learns that a job
ended from the worker's `mlxq:done:<id>` publish, then reads `mlxq:result:<id>`.

The producer side is one thread: it submits what is due, blocks on a pattern subscription to the
done channels, and submits the next request of a closed-loop client as soon as its previous one
ended, so the client side costs the worker's cores as little as possible.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Optional

import redis

from mlxq.bench.arms import Arm
from mlxq.bench.procs import ProcessSet, library_loaded, log_tail
from mlxq.bench.workloads import Arrivals, BenchRequest, RequestRecord, Workload
from producer import Client, WaitTimeout
from producer.pubsub import read_burst
from schemas import GenerationResult, keys
from worker.process_group import child_settings
from worker.settings import WorkerSettings

# What one worker of several gets a share of, as under `mlxq worker --processes W`.
SHARED_SETTINGS = ("MLXQ_MAX_NUM_SEQS", "MLXQ_KV_BUDGET_MB", "MLXQ_PREFIX_CACHE_MB", "MLXQ_BLAS_THREADS", "MLXQ_GROUP")

JOB_TIMEOUT_S = 3600  # RQ's 180 s default could end long queued-then-slow jobs of a big sweep
SAFETY_POLL_S = 2.0  # re-read result keys this often in case a done message was missed


def payload(request: BenchRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt_token_ids": list(request.prompt.ids),
        "max_tokens": request.max_tokens,
        "temperature": request.temperature,
        "ignore_eos": True,
    }
    if request.n != 1:
        body["n"] = request.n
    if request.seed is not None:
        body["seed"] = request.seed
    return body


class MlxqCluster:
    """W worker processes on one Redis. Worker i also listens on its own warm-up queue first, so a
    warm-up pass reaches every worker; measured jobs go to one shared bench queue.

    `max_num_seqs` is the cluster's, as it is B's and D's: each worker gets its share. With several
    workers and a preloaded BLAS (Linux CPU), each also gets its share of the cores for BLAS threads,
    as a CPU host running several workers should (`MLXQ_BLAS_THREADS`)."""

    def __init__(self, url: str, model: str, workers: int, max_num_seqs: int, prefill_batch_size: int,
                 procs: ProcessSet, *, blas_path: Optional[str] = None,
                 worker_argv: Optional[Callable[[str, list[str]], list[str]]] = None,
                 env: Optional[dict[str, str]] = None) -> None:
        self.url = url
        self.model = model
        self.workers = workers
        self.max_num_seqs = max_num_seqs
        self.env = dict(env or {})  # extra environment for the worker processes (MLXQ_* settings)
        tag = f"{os.getpid()}-{time.time_ns() % 10**9}"
        # Several workers share the host's settings and its waiting jobs out as `mlxq worker
        # --processes W` does.
        host = WorkerSettings.from_env(self.env, max_num_seqs=max_num_seqs)
        self.shares = (child_settings(host, workers, os.cpu_count() or 1, split_blas_threads=bool(blas_path),
                                      group=f"bench-{tag}")
                       if workers > 1 else [host])
        self.prefill_batch_size = prefill_batch_size
        self.procs = procs
        self.blas_path = blas_path
        self.worker_argv = worker_argv
        self.queue = f"mlxq-bench-{tag}"
        self.warm_queues = [f"mlxq-bench-warm-{tag}-{i}" for i in range(workers)]
        self.names = [f"bench-{tag}-{i}" for i in range(workers)]
        self.conn: Optional[redis.Redis] = None
        self.client: Optional[Client] = None
        self._procs: list[Any] = []

    def start(self, ready_timeout: float = 900.0, probe: Optional[dict[str, Any]] = None) -> list[GenerationResult]:
        """Start the workers and wait until each answered `probe` (default: one tiny job), sent to
        its own queue as the processes start; their answers."""
        self.conn = redis.Redis.from_url(self.url)
        self.client = Client(connection=self.conn)
        for i in range(self.workers):
            queues = [self.warm_queues[i], self.queue]
            argv = (self.worker_argv(self.names[i], queues) if self.worker_argv else
                    [sys.executable, "-m", "mlxq", "worker", "--url", self.url, "--model", self.model,
                     "--name", self.names[i], "--log-level", "WARNING", *queues])
            env = {"MLXQ_PREFILL_BATCH_SIZE": str(self.prefill_batch_size), **self.env,
                   **{name: value for name, value in self.shares[i].to_env().items() if name in SHARED_SETTINGS}}
            self._procs.append(self.procs.start(self.names[i], argv, env))
        # Readiness: one job through each worker's own queue (it loads the model first).
        probe = probe or {"prompt_token_ids": [1, 2, 3], "max_tokens": 1, "temperature": 0.0, "ignore_eos": True}
        ids = [self.client.submit(probe, queue=q, timeout=JOB_TIMEOUT_S) for q in self.warm_queues]
        return self._wait(ids, ready_timeout)

    def _wait(self, ids: list[str], timeout: float) -> list[GenerationResult]:
        assert self.client is not None
        deadline = time.monotonic() + timeout
        while True:
            dead = [(name, p) for name, p in zip(self.names, self._procs) if p.poll() is not None]
            if dead:
                name, proc = dead[0]
                tail = log_tail(self.procs.log_dir / f"{name}.log")
                raise RuntimeError(f"worker {name} exited with code {proc.returncode}:\n{tail}")
            try:
                results = self.client.wait_many(ids, timeout=min(5.0, max(0.1, deadline - time.monotonic())))
                return [results[i] for i in ids]
            except WaitTimeout:  # check that the workers are alive, then go on waiting
                if time.monotonic() > deadline:
                    raise

    def results(self, ids: list[str], timeout: float) -> list[GenerationResult]:
        """The results of `ids`, in order, once every one has ended (a worker that died raises)."""
        return self._wait(ids, timeout)

    def warm(self, workload: Workload) -> None:
        """Run `workload`'s requests through every worker (each on its own queue) and wait."""
        assert self.client is not None
        ids: list[str] = []
        for queue in self.warm_queues:
            ids += self.client.submit_many([payload(r) for r in workload.requests], queue=queue, timeout=JOB_TIMEOUT_S)
        self._wait(ids, 1800.0)

    def worker_stats(self, prefix: str, worker: int = 0) -> dict[str, str]:
        """One worker's stats-hash fields named `prefix...` (prefix dropped), as strings."""
        assert self.conn is not None
        raw = self.conn.hgetall(keys.stats_key(self.names[worker]))
        return {k.decode()[len(prefix):]: v.decode() for k, v in raw.items() if k.decode().startswith(prefix)}

    def time_counters(self) -> dict[str, float]:
        """The engine's and the loop's time counters (`engine_*`, `loop_*`), summed over workers."""
        total: dict[str, float] = {}
        for worker in range(self.workers):
            for prefix in ("engine_", "loop_"):
                for name, value in self.worker_stats(prefix, worker).items():
                    key = prefix + name
                    total[key] = total.get(key, 0.0) + float(value)
        return total

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def blas_loaded(self) -> list[Optional[bool]]:
        return [library_loaded(pid, self.blas_path) for pid in self.pids()]

    def stop(self) -> None:
        for proc in self._procs:
            self.procs.stop(proc)
        self._procs = []
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def with_result_keys(conn: redis.Redis, job_ids: list[str]) -> list[str]:
    """Those of `job_ids` whose result key exists: the jobs that ended, whatever pub/sub missed."""
    return [job_id for job_id, raw in zip(job_ids, conn.mget([keys.result_key(j) for j in job_ids])) if raw]


def drive(cluster: MlxqCluster, workload: Workload, timeout_s: float,
          make_payload: Callable[[BenchRequest], dict[str, Any]] = payload) -> list[RequestRecord]:
    """Submit `workload` as its arrivals say, collect every result; times relative to the start."""
    conn, client = cluster.conn, cluster.client
    assert conn is not None and client is not None
    pubsub = conn.pubsub()
    pubsub.psubscribe(keys.done_channel("*"))
    while True:  # only after the confirmation can no publish slip by unseen
        message = pubsub.get_message(timeout=10.0)
        if message is None:
            raise RuntimeError("no psubscribe confirmation from Redis")
        if message["type"] == "psubscribe":
            break
    arrivals = Arrivals(workload)
    inflight: dict[str, tuple[BenchRequest, RequestRecord]] = {}
    ended: dict[str, RequestRecord] = {}
    t0_wall, t0 = time.time(), time.perf_counter()
    deadline = t0 + timeout_s
    next_poll = t0 + SAFETY_POLL_S

    def end(job_id: str) -> None:
        entry = inflight.pop(job_id, None)
        if entry is not None:
            request, record = entry
            record.finished = time.perf_counter() - t0
            ended[job_id] = record
            arrivals.completed(request, record.finished)

    try:
        while inflight or not arrivals.exhausted:
            due = arrivals.due(time.perf_counter() - t0)
            if due:
                ids = client.submit_many([make_payload(r) for r, _ in due], queue=cluster.queue,
                                         timeout=JOB_TIMEOUT_S, result_ttl=JOB_TIMEOUT_S)
                submitted = time.perf_counter() - t0
                for job_id, (request, arrival) in zip(ids, due):
                    inflight[job_id] = (request, RequestRecord(request.index, arrival,
                                                               extra={"job_id": job_id, "submitted": submitted}))
            now = time.perf_counter()
            if now > deadline:
                break
            upcoming = arrivals.next_arrival()
            wait = 0.5 if upcoming is None else max(0.0, min(0.5, upcoming - (now - t0)))
            messages, whole = read_burst(pubsub, wait)
            for message in messages:
                if message["type"] == "pmessage":
                    end(message["data"].decode())
            if (not whole or time.perf_counter() >= next_poll) and inflight:
                for job_id in with_result_keys(conn, list(inflight)):
                    end(job_id)
                next_poll = time.perf_counter() + SAFETY_POLL_S
    finally:
        pubsub.close()
    records = list(ended.values())
    for job_id, (_, record) in inflight.items():
        record.error = f"no result within {timeout_s:.0f} s"
        records.append(record)
    _fill_from_results(conn, ended, t0_wall)
    return sorted(records, key=lambda r: r.index)


def _fill_from_results(conn: redis.Redis, ended: dict[str, RequestRecord], t0_wall: float) -> None:
    ids = list(ended)
    for start in range(0, len(ids), 500):
        chunk = ids[start:start + 500]
        for job_id, raw in zip(chunk, conn.mget([keys.result_key(j) for j in chunk])):
            record = ended[job_id]
            if raw is None:
                record.error = "result key missing"
                continue
            result = GenerationResult.model_validate_json(raw)
            fill_from_result(record, result, t0_wall)
            record.extra.update(worker=result.worker,
                                worker_finished=(result.timings.finished_at or t0_wall) - t0_wall)


def fill_from_result(record: RequestRecord, result: GenerationResult, t0_wall: float) -> None:
    """A request's start, first token, tokens, error and speculation from its result (times on the
    wall clock, made relative to `t0_wall`)."""
    timings = result.timings
    if timings.started_at is not None:
        record.started = timings.started_at - t0_wall
        if timings.ttft_s is not None:
            record.first_token = timings.started_at + timings.ttft_s - t0_wall
    record.tokens = result.usage.completion_tokens
    if result.choices:
        record.extra["token_ids"] = result.choices[0].token_ids
    if result.speculation is not None:
        record.extra["speculation"] = result.speculation.model_dump()
    if result.status != "finished":
        error = result.error
        record.error = f"{result.status}: {error.type}: {error.message}" if error else result.status


class MlxqArm(Arm):
    key = "C"
    methods = {
        "queue": "the result's timings.queue_s basis: enqueue (producer) to the worker starting the job",
        "ttft": "enqueue to timings.started_at + timings.ttft_s (the worker's clock, same machine)",
        "e2e": "enqueue to the producer receiving the job's mlxq:done publish (after the result key is written)",
        "eos": "requests carry ignore_eos: true",
    }

    def __init__(self, cluster: MlxqCluster, timeout_s: float) -> None:
        self.cluster = cluster
        self.timeout_s = timeout_s
        self.key = f"C{cluster.workers}"

    def start(self) -> None:
        self.cluster.start()

    def stop(self) -> None:
        self.cluster.stop()

    def info(self) -> dict[str, Any]:
        return {"workers": self.cluster.workers, "max_num_seqs": self.cluster.max_num_seqs,
                "max_num_seqs_per_worker": [share.max_num_seqs for share in self.cluster.shares],
                "blas_threads_per_worker": self.cluster.shares[0].blas_threads,
                "prefill_batch_size": self.cluster.prefill_batch_size, "blas_loaded": self.cluster.blas_loaded()}

    def run(self, workload: Workload, warmup: Optional[Workload]) -> list[RequestRecord]:
        if warmup is not None:
            self.cluster.warm(warmup)
        before = self.cluster.time_counters()
        records = drive(self.cluster, workload, self.timeout_s)
        after = self.cluster.time_counters()
        # Summed over several workers, engine seconds would exceed the wall time: report the mean worker.
        workers = self.cluster.workers
        self.time_split = {name: (after[name] - before.get(name, 0.0)) / workers for name in after}
        self.time_split["workers"] = workers
        return records
