"""The issue's extra scenarios, each through real worker processes on the harness's Redis:

- overhead: a zero-cost FakeEngine worker; jobs/s end to end, and the step interval while 256
  results are published compared with an ordinary step (with a fixed fake step cost);
- late-joiner: a short job arriving while 31 long ones decode; decode steps until its first token;
- rl: 64 prompts x n=8 samples as n=8 requests vs the same samples as 512 independent requests;
- prefix-cache: 64 requests at once sharing a 512-token system prompt, with the worker's prefix
  cache on and then off.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from typing import Any, Optional, Protocol

from mlxq.bench.arm_mlxq import JOB_TIMEOUT_S, MlxqCluster, drive, payload
from mlxq.bench.config import BenchConfig
from mlxq.bench.metrics_scrape import MetricsScraper
from mlxq.bench.procs import ProcessSet
from mlxq.bench.stats import distribution, median, summarize
from mlxq.bench.workloads import BenchRequest, Prompt, Tokenizer, Workload, all_at_once, make_prompts
from schemas import keys

SUSTAINED_JOBS_PER_BURST_JOB = 5  # the sustained run is this many times --overhead-jobs
PUBLISH_ROUNDS = 3  # the publish phase runs this many times, each on a fresh worker: one step each is noisy


class ClusterFactory(Protocol):
    """A model-backed cluster of `workers` processes; `env`: extra MLXQ_* settings for them."""

    def __call__(self, workers: int, max_num_seqs: int, env: Optional[dict[str, str]] = None) -> MlxqCluster: ...


def fake_cluster(cfg: BenchConfig, url: str, procs: ProcessSet, max_num_seqs: int, step_ms: float,
                 step_log: str) -> MlxqCluster:
    def argv(name: str, queues: list[str]) -> list[str]:
        return [sys.executable, "-m", "mlxq.bench.fake_worker", "--url", url, "--name", name,
                "--max-num-seqs", str(max_num_seqs), "--step-ms", str(step_ms), "--step-log", step_log,
                *(["--metrics-port", str(cfg.metrics_port)] if cfg.metrics_port is not None else []), *queues]

    return MlxqCluster(url, "fake", 1, max_num_seqs, cfg.prefill_batch_size, procs, worker_argv=argv)


def _fake_jobs(count: int, max_tokens: int, offset: int = 0) -> list[BenchRequest]:
    # FakeEngine: a 256-id vocabulary, 253-255 reserved for fault injection; distinct prompts.
    return [BenchRequest(i, Prompt("", (1 + (i + offset) % 250, 2, 3)), max_tokens) for i in range(count)]


def overhead(cfg: BenchConfig, url: str, procs: ProcessSet) -> dict[str, Any]:
    if cfg.metrics_port is None:
        return _overhead(cfg, url, procs)
    with MetricsScraper(cfg.metrics_port) as scraper:
        result = _overhead(cfg, url, procs)
    return {**result, "metrics": scraper.summary()}


def _overhead(cfg: BenchConfig, url: str, procs: ProcessSet) -> dict[str, Any]:
    # Phase 1: jobs/s with a free engine: the queue's own ceiling.
    log1 = cfg.logs / "fake-steps-throughput.json"
    cluster = fake_cluster(cfg, url, procs, 256, 0.0, str(log1))
    cluster.start()
    try:
        cluster.warm(all_at_once(_fake_jobs(100, cfg.overhead_tokens, 7), "warmup"))
        workload = all_at_once(_fake_jobs(cfg.overhead_jobs, cfg.overhead_tokens), "overhead-jobs")
        records = drive(cluster, workload, cfg.request_timeout_s)
        sustained = _sustained(cluster, cfg)
    finally:
        cluster.stop()
    summary = summarize(workload, records)
    starts = [r.started for r in records if r.started is not None]
    ends = [r.extra["worker_finished"] for r in records if "worker_finished" in r.extra]
    worker_wall = (max(ends) - min(starts)) if starts and ends else None
    throughput = {
        "jobs": cfg.overhead_jobs, "max_tokens": cfg.overhead_tokens, "max_num_seqs": 256,
        "completed": summary["completed"], "failed": summary["failed"], "wall_s": summary["wall_s"],
        "jobs_per_s": summary["requests_per_s"],
        "worker_jobs_per_s": (summary["completed"] / worker_wall) if worker_wall else None,
        "e2e_s": summary["e2e_s"],
        "sustained": sustained,
    }

    rounds = [_publish_round(cfg, url, procs, i) for i in range(PUBLISH_ROUNDS)]
    publish = {name: median([r[name] for r in rounds])
               for name in ("publish_step_ms", "publishing_step_ms", "admit_step_ms", "publish_stall_ms")}
    publish.update(plain_step_p50_ms=median([(r["plain_step_ms"] or {}).get("p50") for r in rounds]),
                   burst_batch_step_p50_ms=median([(r["burst_batch_step_ms"] or {}).get("p50") for r in rounds]),
                   rounds=rounds, fake_step_ms=cfg.overhead_step_ms,
                   burst_jobs=rounds[0]["burst_jobs"], background_jobs=rounds[0]["background_jobs"],
                   burst_finished=sum(r["burst_finished"] for r in rounds),
                   joiners_finished=sum(r["joiners_finished"] for r in rounds))
    return {"throughput": throughput, "publish": publish,
            "method": "FakeEngine worker (no model); jobs submitted at once with submit_many; jobs/s from the "
                      "first submit to the last mlxq:done message. Step intervals from the engine's own step log; "
                      f"the publish phase's figures are the median of {PUBLISH_ROUNDS} rounds, each on a fresh worker."}


def _publish_round(cfg: BenchConfig, url: str, procs: ProcessSet, round_no: int) -> dict[str, Any]:
    """Step intervals while many results are published (fixed fake step cost)."""
    log2 = cfg.logs / f"fake-steps-publish-{round_no}.json"
    burst, background = cfg.overhead_publish, 16
    cluster = fake_cluster(cfg, url, procs, burst + background, cfg.overhead_step_ms, str(log2))
    cluster.start()
    try:
        client = cluster.client
        assert client is not None
        # Into an idle worker, all start together: the burst's results are published in one step,
        # and the background jobs decode on for ~140 steps after it. A second burst then joins them
        # (the worker starts a few dozen a turn while sequences decode).
        long_ids = client.submit_many([payload(r) for r in _fake_jobs(background, 150, 300)]
                                      + [payload(r) for r in _fake_jobs(burst, 8, 600)],
                                      queue=cluster.queue, timeout=JOB_TIMEOUT_S)
        short_ids = long_ids[background:]
        time.sleep(max(0.2, 30 * cfg.overhead_step_ms / 1000))
        joiner_ids = client.submit_many([payload(r) for r in _fake_jobs(burst, 8, 900)],
                                        queue=cluster.queue, timeout=JOB_TIMEOUT_S)
        short = client.wait_many(short_ids + joiner_ids, timeout=600)
        client.wait_many(long_ids, timeout=600)
    finally:
        cluster.stop()
    steps = json.loads(log2.read_text()) if log2.exists() else []
    publish = analyze_steps(steps, burst, running=background)
    publish.update(background_jobs=background, burst_jobs=burst,
                   burst_finished=sum(short[i].status == "finished" for i in short_ids),
                   joiners_finished=sum(short[i].status == "finished" for i in joiner_ids))
    return publish


def _sustained(cluster: MlxqCluster, cfg: BenchConfig) -> dict[str, Any]:
    """Jobs arrive at the offered rate (submitted as they fall due, a few per submit): the rate at
    which results land over the middle 80% of the run is the rate submitted if one worker keeps up,
    and what it sustains with the producer beside it if not (not a burst's drain). The rate the
    producer actually submitted at is reported beside it: on a busy machine it can fall short of
    the rate offered."""
    count, rate = SUSTAINED_JOBS_PER_BURST_JOB * cfg.overhead_jobs, cfg.overhead_offered_per_s
    requests = [BenchRequest(i, r.prompt, r.max_tokens, client=i, arrival_s=i / rate)
                for i, r in enumerate(_fake_jobs(count, cfg.overhead_tokens, 11))]
    workload = Workload("open", "overhead-sustained", requests, rate=rate)
    records = drive(cluster, workload, cfg.request_timeout_s)
    finished = sorted(r.finished for r in records if r.finished is not None and r.error is None)
    submitted = sorted(r.extra["submitted"] for r in records if "submitted" in r.extra)
    return {"jobs": count, "offered_per_s": rate, "completed": len(finished),
            "submitted_per_s": _middle_rate(submitted), "jobs_per_s": _middle_rate(finished)}


def _middle_rate(times: list[float]) -> Optional[float]:
    """Events per second over the middle 80% of sorted event times."""
    middle = times[len(times) // 10: len(times) - len(times) // 10]
    span = middle[-1] - middle[0] if len(middle) > 1 else 0.0
    return (len(middle) - 1) / span if span > 0 else None


def analyze_steps(steps: list[list[Any]], burst: int, running: int) -> dict[str, Any]:
    """Intervals between engine steps, each step logged as (start, active, bookkeeping busy):
    ordinary ones (same batch, bookkeeping idle), the one in which `burst` jobs ended (the engine
    and scheduler end them; their results are handed to bookkeeping), the ones right after it, of
    the same batch, while bookkeeping was still writing those results and ending their RQ jobs,
    and the longest in which jobs joined the `running` ones mid-decode (the worker starts at most
    ADMIT_PER_TURN_WHILE_DECODING a turn, so a burst joins over a few)."""
    plain, ending, publishing, admit = [], [], [], []
    plain_by_size: dict[int, list[float]] = {}
    ending_size = None
    after_ending = False  # in the steps that follow the burst's ending, while its results are written
    for (t, active, *busy), (t_next, active_next, *_) in zip(steps, steps[1:]):
        interval, change = (t_next - t) * 1000, active_next - active
        busy_now = bool(busy and busy[0])
        after_ending = after_ending and busy_now and change == 0
        if change == 0 and active > 0:
            if after_ending:
                publishing.append(interval)
            elif not busy_now:
                plain.append(interval)
                plain_by_size.setdefault(active, []).append(interval)
        elif change <= -burst * 0.9:
            ending.append(interval)
            ending_size = active
            after_ending = True
        elif change > 0 and active >= running:
            admit.append(interval)
    base = statistics.median(plain) if plain else None
    worst_ending = max(ending) if ending else None
    return {
        "steps": len(steps),
        "plain_step_ms": distribution(plain),
        "publish_step_ms": worst_ending,
        # the plain steps of the batch the burst ended from: the engine's per-sequence work grows with it
        "burst_batch_step_ms": distribution(plain_by_size.get(ending_size, [])) if ending_size else None,
        "publishing_step_ms": max(publishing) if publishing else None,
        "publishing_steps": len(publishing),
        "admit_step_ms": max(admit) if admit else None,
        "publish_stall_ms": (worst_ending - base) if worst_ending is not None and base is not None else None,
    }


# Short jobs join after a random pause of up to this long, so that they land anywhere in the worker's turn.
LATE_JOIN_SPREAD_S = 0.02


def _late_join_round(cfg: BenchConfig, client: Any, queue: str, prompts: list[Any], joining: list[Any],
                     rng: random.Random) -> tuple[list[tuple[Any, float]], list[Any]]:
    """Long jobs decode; short jobs join them one after another, one per prompt of `joining` (prompts
    no job had before: nothing of theirs is in the prefix cache), each submitted a random part of a
    decode step after the one before ended (so joins land anywhere in the worker's turn). Returns
    each short job's result with its submit time, and the long jobs' results."""
    longs = [BenchRequest(i, prompts[i], cfg.late_long_tokens) for i in range(cfg.late_long)]
    # The long jobs stream, so we can wait until every one of them is past its prefill and
    # decoding: the short job must join a decoding batch, not queue behind prompts.
    long_ids = client.submit_many([{**payload(r), "stream": True} for r in longs], queue=queue,
                                  timeout=JOB_TIMEOUT_S)
    _wait_decoding(client, long_ids, timeout=cfg.request_timeout_s)
    time.sleep(cfg.late_delay_s)
    shorts = []
    for join, prompt in enumerate(joining):
        time.sleep(rng.uniform(0, LATE_JOIN_SPREAD_S))
        submitted = time.time()
        short_id = client.submit(payload(BenchRequest(join, prompt, cfg.late_short_tokens)), queue=queue,
                                 timeout=JOB_TIMEOUT_S)
        shorts.append((client.wait(short_id, timeout=cfg.request_timeout_s), submitted))
    for job_id in long_ids:
        client.cancel(job_id)
    long_results = list(client.wait_many(long_ids, timeout=cfg.request_timeout_s).values())
    return shorts, long_results


def _first_token_after_submit(result: Any, submitted: float) -> Optional[float]:
    t = result.timings
    return (t.started_at + t.ttft_s - submitted) if t.started_at and t.ttft_s is not None else None


def late_joiner(cfg: BenchConfig, tokenizer: Tokenizer, make_cluster: ClusterFactory) -> dict[str, Any]:
    cluster = make_cluster(1, max(cfg.max_num_seqs, cfg.late_long + 1))
    # The long jobs', the warm-up's, then one fresh prompt per join (the first round's, then the reported).
    warm_prompts = 8
    prompts = make_prompts(tokenizer, cfg.late_long + warm_prompts + 1 + cfg.late_joins, cfg.prompt_tokens,
                           seed=cfg.seed, salt="late")
    joining = prompts[cfg.late_long + warm_prompts:]
    rng = random.Random(cfg.seed)
    cluster.start()
    try:
        client = cluster.client
        assert client is not None
        warm = prompts[cfg.late_long:cfg.late_long + warm_prompts]
        cluster.warm(all_at_once([BenchRequest(i, p, cfg.warmup_tokens) for i, p in enumerate(warm)], "warm"))
        # A first round also compiles the shapes a late join creates (a one-prompt prefill beside a
        # running batch: slow the first time on a GPU); the second is reported.
        warmup, _ = _late_join_round(cfg, client, cluster.queue, prompts, joining[:1], rng)
        shorts, long_results = _late_join_round(cfg, client, cluster.queue, prompts, joining[1:], rng)
    finally:
        cluster.stop()
    step_times = []
    for result in long_results:
        t = result.timings
        if t.started_at and t.ttft_s is not None and t.finished_at and result.usage.completion_tokens > 1:
            step_times.append((t.finished_at - t.started_at - t.ttft_s) / (result.usage.completion_tokens - 1))
    step = statistics.median(step_times) if step_times else None
    joins = [{"status": short.status, "queue_s": short.timings.queue_s, "ttft_s_worker": short.timings.ttft_s,
              "first_token_after_submit_s": _first_token_after_submit(short, submitted)} for short, submitted in shorts]
    firsts = [j["first_token_after_submit_s"] for j in joins if j["first_token_after_submit_s"] is not None]
    steps = [first / step for first in firsts] if step else []
    return {
        "first_round_first_token_after_submit_s": _first_token_after_submit(*warmup[0]),
        "long_jobs": cfg.late_long, "long_max_tokens": cfg.late_long_tokens,
        "long_tokens_when_cancelled": statistics.mean(r.usage.completion_tokens for r in long_results),
        "decode_step_s": step,
        "joins": joins,
        "first_token_after_submit_s": statistics.median(firsts) if firsts else None,
        "steps_to_first_token": statistics.median(steps) if steps else None,
        "steps_to_first_token_each": steps,
        "method": "decode step = median over the long jobs of (finished - first token) / (tokens - 1); "
                  "steps = (a short job's first token - its submit) / decode step, median over the joins",
    }


def _wait_decoding(client: Any, job_ids: list[str], timeout: float) -> None:
    """Until every job has streamed its first token."""
    deadline = time.monotonic() + timeout
    pending = list(job_ids)
    while pending:
        pending = [j for j in pending if not client.connection.exists(keys.stream_key(j))]
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(pending)} long jobs never produced a token")
        time.sleep(0.05)


def rl(cfg: BenchConfig, tokenizer: Tokenizer, make_cluster: ClusterFactory) -> dict[str, Any]:
    """RL rollouts: the same samples as n=8 requests, and as independent requests, each on a fresh
    worker. Independent requests are run twice: with the prefix cache off (nothing is shared across
    requests: the baseline the n=8 speedup is measured against) and on (identical prompts admitted
    together share a prefill, as the n choices of one request do)."""
    n = cfg.rl_n
    # Warm-ups of one full batch of the measured shape, on other prompts: a GPU backend compiles
    # kernels for each new shape, and a shape's first run is far slower (notes/mlx.md).
    wave = max(1, min(cfg.rl_prompts, cfg.max_num_seqs // n))
    prompts = make_prompts(tokenizer, cfg.rl_prompts + wave, cfg.rl_prompt_tokens, seed=cfg.seed, salt="rl")

    def as_n_requests(first: int, count: int, label: str) -> Workload:
        return all_at_once([BenchRequest(i, prompts[first + i], cfg.rl_new_tokens, n=n, temperature=1.0, seed=i)
                            for i in range(count)], label)

    def as_independent(first: int, count: int, label: str) -> Workload:
        return all_at_once([BenchRequest(i * n + j, prompts[first + i], cfg.rl_new_tokens, temperature=1.0,
                                         seed=i * n + j) for i in range(count) for j in range(n)], label)

    grouped = as_n_requests(0, cfg.rl_prompts, f"rl-n{n}")
    independent = as_independent(0, cfg.rl_prompts, "rl-independent")
    warm_grouped = as_n_requests(cfg.rl_prompts, wave, "warm")
    warm_independent = as_independent(cfg.rl_prompts, wave, "warm")
    runs = {}
    for label, workload, warm, cache_mb in (("grouped", grouped, warm_grouped, None),
                                            ("independent", independent, warm_independent, "0"),
                                            ("independent_prefix_cache", independent, warm_independent, None)):
        cluster = make_cluster(1, cfg.max_num_seqs, {"MLXQ_PREFIX_CACHE_MB": cache_mb} if cache_mb else None)
        cluster.start()
        try:
            cluster.warm(warm)
            before = cluster.time_counters()
            runs[label] = _brief(summarize(workload, drive(cluster, workload, cfg.request_timeout_s)))
            runs[label]["engine"] = _engine_split(before, cluster.time_counters())
        finally:
            cluster.stop()

    def ratio(a: str, b: str) -> Optional[float]:
        x, y = runs[a]["tokens_per_s"], runs[b]["tokens_per_s"]
        return x / y if x and y else None

    def engine_s(label: str) -> float:
        return runs[label]["engine"]["prefill_s"] + runs[label]["engine"]["decode_s"]

    return {
        "prompts": cfg.rl_prompts, "n": n, "prompt_tokens": cfg.rl_prompt_tokens, "new_tokens": cfg.rl_new_tokens,
        "max_num_seqs": cfg.max_num_seqs, "sampling": "temperature 1.0, seeded per request, ignore_eos",
        **runs, "speedup": ratio("grouped", "independent"),
        "independent_prefix_cache_speedup": ratio("independent_prefix_cache", "independent"),
        # The speedup the engine's own prefill and decode time allows, queue aside: what the queue
        # around the engine can at best give on this machine.
        "engine_time_speedup": engine_s("independent") / engine_s("grouped") if engine_s("grouped") else None,
        "method": "each run on a fresh worker after a warm-up of one full batch in its own form, on other prompts; "
                  "independent = the same samples as "
                  f"{cfg.rl_prompts * n} requests of n=1, with MLXQ_PREFIX_CACHE_MB=0 (no sharing across requests); "
                  "independent_prefix_cache = the same with the default prefix cache",
    }


def _engine_split(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the engine spent on the run: prefill against decode seconds, calls and steps."""
    names = ("prefill_s", "prefill_calls", "own_prefills", "prefill_tokens", "decode_s", "decode_steps",
             "decode_tokens")
    return {name: after.get(f"engine_{name}", 0.0) - before.get(f"engine_{name}", 0.0) for name in names}


def _brief(summary: dict[str, Any]) -> dict[str, Any]:
    keep = ("requests", "completed", "failed", "tokens", "wall_s", "tokens_per_s", "requests_per_s", "e2e_s")
    return {k: summary[k] for k in keep}


def prefix_cache(cfg: BenchConfig, tokenizer: Tokenizer, make_cluster: ClusterFactory) -> dict[str, Any]:
    """The same requests, all sent at once, every one starting with one shared system prompt: on a
    worker with the prefix cache on, then on one with MLXQ_PREFIX_CACHE_MB=0."""
    n = cfg.prefix_requests
    shared = make_prompts(tokenizer, 2, cfg.prefix_shared_tokens, seed=cfg.seed, salt="prefix-shared")
    own = make_prompts(tokenizer, 2 * n, cfg.prefix_suffix_tokens, seed=cfg.seed, salt="prefix-own")
    measured = all_at_once([BenchRequest(i, _joined(shared[0], own[i]), cfg.prefix_new_tokens) for i in range(n)],
                           "prefix-shared")
    # The warm-up has the measured run's shape (so a GPU backend has compiled its kernels) but
    # another system prompt, so the measured run starts with a cold cache.
    warm = all_at_once([BenchRequest(i, _joined(shared[1], own[n + i]), cfg.prefix_new_tokens) for i in range(n)],
                       "warm")
    runs = {}
    for label, cache_mb in (("cache_on", cfg.prefix_cache_mb), ("cache_off", 0)):
        runs[label] = _prefix_run(cfg, make_cluster, {"MLXQ_PREFIX_CACHE_MB": str(cache_mb)}, measured, warm)
    on, off = runs["cache_on"], runs["cache_off"]
    speedup = on["tokens_per_s"] / off["tokens_per_s"] if on["tokens_per_s"] and off["tokens_per_s"] else None
    prompt_tokens = sum(len(r.prompt.ids) for r in measured.requests)
    # The shared prefix's share of the prompt tokens, counted once per request but the first.
    ideal = (n - 1) * len(shared[0].ids) / prompt_tokens if prompt_tokens else None
    return {
        "requests": n, "shared_tokens": len(shared[0].ids), "own_tokens": cfg.prefix_suffix_tokens,
        "new_tokens": cfg.prefix_new_tokens, "max_num_seqs": cfg.max_num_seqs, "cache_mb": cfg.prefix_cache_mb,
        "sampling": "greedy, ignore_eos", "cache_on": on, "cache_off": off, "speedup": speedup,
        "hit_rate": on["worker_stats"].get("hit_rate"), "hit_rate_ideal": ideal,
        "method": "hit rate = reused prompt tokens / prompt tokens looked up during the measured run, from the "
                  f"worker's {keys.stats_key('<worker>')} hash (before/after difference)",
    }


def _joined(first: Prompt, second: Prompt) -> Prompt:
    return Prompt(first.text + " " + second.text, first.ids + second.ids)


def _prefix_run(cfg: BenchConfig, make_cluster: ClusterFactory, env: dict[str, str], measured: Workload,
                warm: Workload) -> dict[str, Any]:
    cluster = make_cluster(1, cfg.max_num_seqs, env)
    cluster.start()
    try:
        cluster.warm(warm)
        before = cluster.worker_stats("prefix_cache_")
        summary = summarize(measured, drive(cluster, measured, cfg.request_timeout_s))
        after = cluster.worker_stats("prefix_cache_")
    finally:
        cluster.stop()
    ttft = summary["ttft_s"]
    return {**_brief(summary), "ttft_p50_s": ttft["p50"] if ttft else None, "ttft_s": ttft,
            "worker_stats": stats_delta(before, after)}


def stats_delta(before: dict[str, str], after: dict[str, str]) -> dict[str, Any]:
    """The measured run's share of the worker's cumulative counters (the warm-up came first)."""
    if not after:
        return {}
    counters = ("lookups", "hits", "prompt_tokens", "reused_tokens")
    out: dict[str, Any] = {k: v for k, v in after.items() if k not in counters}
    for name in counters:
        if name in after:
            out[name] = int(float(after[name])) - int(float(before.get(name, 0)))
    if out.get("prompt_tokens"):
        out["hit_rate"] = out.get("reused_tokens", 0) / out["prompt_tokens"]
    elif "hit_rate" in after:
        out["hit_rate"] = float(after["hit_rate"])
    return out
