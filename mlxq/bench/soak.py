"""The soak scenario: thousands of mixed jobs (some invalid) arriving over time at one worker.

Samples the worker's RSS (psutil) and the completion count once a `soak_sample_s`, and at the end
counts lost jobs (submitted without a result key), failures of valid jobs, and invalid jobs that
did not fail. Invalid jobs are the kinds the worker must refuse without harm: token ids outside the
vocabulary, and an RQ job naming a function outside the allowlist.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any, Optional

from rq import Queue

from mlxq.bench.arm_mlxq import JOB_TIMEOUT_S, MlxqCluster, with_result_keys
from mlxq.bench.config import BenchConfig
from mlxq.bench.workloads import BenchRequest, Prompt, Tokenizer, all_at_once, make_prompts
from producer.pubsub import read_burst
from schemas import GenerationResult, keys
from schemas.serializer import JSON_SERIALIZER

OUT_OF_VOCAB = 10_000_000  # beyond any model's vocabulary


@dataclass
class SoakJob:
    arrival_s: float
    kind: str  # "valid" | "bad-token" | "bad-function"
    body: dict[str, Any]


def plan_jobs(cfg: BenchConfig, prompt_ids: list[tuple[int, ...]]) -> list[SoakJob]:
    rng = random.Random(f"{cfg.seed}/soak")
    jobs, arrival = [], 0.0
    for i in range(cfg.soak_jobs):
        arrival += rng.expovariate(cfg.soak_rate)
        ids = list(prompt_ids[i % len(prompt_ids)][: rng.randint(4, max(4, cfg.prompt_tokens))])
        body: dict[str, Any] = {"prompt_token_ids": ids, "max_tokens": rng.randint(1, cfg.soak_max_tokens)}
        roll = rng.random()
        kind = "valid"
        if roll < cfg.soak_invalid / 2:
            kind, body["prompt_token_ids"] = "bad-token", ids[:-1] + [OUT_OF_VOCAB]
        elif roll < cfg.soak_invalid:
            kind = "bad-function"
        else:
            body["temperature"] = rng.choice([0.0, 0.8])
            if body["temperature"]:
                body["seed"] = i
            if rng.random() < 0.1:
                body["n"] = 2
            if rng.random() < 0.1:
                body["stop"] = ["e"]
            body["ignore_eos"] = rng.random() < 0.5
        jobs.append(SoakJob(arrival, kind, body))
    return jobs


def soak(cfg: BenchConfig, tokenizer: Optional[Tokenizer], cluster: MlxqCluster) -> dict[str, Any]:
    import psutil

    if tokenizer is not None:
        prompt_ids = [p.ids for p in make_prompts(tokenizer, 64, cfg.prompt_tokens, seed=cfg.seed, salt="soak")]
    else:  # the fake engine: its vocabulary is 256 ids
        prompt_ids = [tuple(1 + (i * 7 + k) % 250 for k in range(cfg.prompt_tokens)) for i in range(64)]
    jobs = plan_jobs(cfg, prompt_ids)
    cluster.start()
    try:
        conn, client = cluster.conn, cluster.client
        assert conn is not None and client is not None
        cluster.warm(all_at_once([BenchRequest(0, Prompt("", prompt_ids[0]), cfg.warmup_tokens)], "warm"))
        process = psutil.Process(cluster.pids()[0])
        raw_queue = Queue(cluster.queue, connection=conn, serializer=JSON_SERIALIZER)
        kinds: dict[str, str] = {}
        done: set[str] = set()
        samples: list[dict[str, float]] = []
        pubsub = conn.pubsub()
        pubsub.psubscribe(keys.done_channel("*"))
        t0 = time.perf_counter()
        next_sample, submitted = t0, 0
        drain_deadline: Optional[float] = None
        while True:
            now = time.perf_counter()
            while submitted < len(jobs) and jobs[submitted].arrival_s <= now - t0:
                job = jobs[submitted]
                if job.kind == "bad-function":
                    job_id = raw_queue.enqueue("os.getcwd", result_ttl=JOB_TIMEOUT_S).id
                else:
                    job_id = client.submit(job.body, queue=cluster.queue, timeout=JOB_TIMEOUT_S,
                                           result_ttl=JOB_TIMEOUT_S)
                kinds[job_id] = job.kind
                submitted += 1
            messages, whole = read_burst(pubsub, 0.05)
            done.update(m["data"].decode() for m in messages if m["type"] == "pmessage")
            if not whole:  # messages may be lost: the result keys say which jobs ended
                done.update(with_result_keys(conn, [job_id for job_id in kinds if job_id not in done]))
            if now >= next_sample:
                samples.append(_sample(now - t0, process, conn, submitted, len(done & kinds.keys())))
                next_sample = now + cfg.soak_sample_s
            if submitted == len(jobs):
                if kinds.keys() <= done:
                    break
                if drain_deadline is None:
                    drain_deadline = now + max(120.0, 0.5 * (now - t0))
                elif now > drain_deadline:
                    break
        samples.append(_sample(time.perf_counter() - t0, process, conn, submitted, len(done & kinds.keys())))
        pubsub.close()
        statuses = _read_statuses(conn, list(kinds))
        pending = _still_pending(conn, [j for j in kinds if j not in statuses])
    finally:
        cluster.stop()
    return _report(cfg, kinds, statuses, pending, samples, len(jobs))


def _sample(t: float, process: Any, conn: Any, submitted: int, done: int) -> dict[str, float]:
    return {"t": t, "rss_bytes": float(process.memory_info().rss), "submitted": float(submitted), "done": float(done),
            "redis_used_bytes": float(conn.info("memory").get("used_memory", 0))}


def _read_statuses(conn: Any, job_ids: list[str]) -> dict[str, str]:
    """Each job's result status; jobs without a result key are absent (lost)."""
    statuses: dict[str, str] = {}
    for start in range(0, len(job_ids), 500):
        chunk = job_ids[start:start + 500]
        for job_id, raw in zip(chunk, conn.mget([keys.result_key(j) for j in chunk])):
            if raw is not None:
                statuses[job_id] = GenerationResult.model_validate_json(raw).status
    return statuses


def _still_pending(conn: Any, job_ids: list[str]) -> set[str]:
    """Jobs without a result that RQ still holds as queued or running: late (the run outpaced the
    worker), not lost. A job is lost only if it has no result and RQ no longer holds it either."""
    pending = set()
    for job_id in job_ids:
        status = conn.hget(f"rq:job:{job_id}", "status")
        if status in (b"queued", b"started", b"scheduled", b"deferred"):
            pending.add(job_id)
    return pending


def _report(cfg: BenchConfig, kinds: dict[str, str], statuses: dict[str, str], pending: set[str],
            samples: list[dict[str, float]], planned: int) -> dict[str, Any]:
    valid = [j for j, k in kinds.items() if k == "valid"]
    invalid = [j for j, k in kinds.items() if k != "valid"]
    rss = [s["rss_bytes"] for s in samples]
    half = len(rss) // 2
    series = []
    for before, after in zip(samples, samples[1:]):
        span = after["t"] - before["t"]
        series.append({"t": after["t"], "jobs_per_s": (after["done"] - before["done"]) / span if span > 0 else 0.0,
                       "rss_mb": after["rss_bytes"] / 2**20})
    duration = samples[-1]["t"] if samples else 0.0
    return {
        "engine": cfg.soak_engine, "jobs": planned, "rate": cfg.soak_rate, "invalid_fraction": cfg.soak_invalid,
        "submitted": len(kinds), "results": len(statuses),
        "still_pending_at_deadline": len(pending), "lost": len(kinds) - len(statuses) - len(pending),
        "valid_not_finished": sum(j not in pending and statuses.get(j) != "finished" for j in valid),
        "invalid_not_failed": sum(j not in pending and statuses.get(j) != "failed" for j in invalid),
        "duration_s": duration,
        "jobs_per_s": (samples[-1]["done"] / duration) if duration else None,
        "rss_mb": {"first": rss[0] / 2**20, "max": max(rss) / 2**20, "last": rss[-1] / 2**20} if rss else None,
        "rss_growth_mb": (rss[-1] - rss[0]) / 2**20 if rss else None,
        "rss_growth_second_half_mb": (rss[-1] - rss[half]) / 2**20 if len(rss) > 1 else None,
        "series": series,
    }
