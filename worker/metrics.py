"""A worker's metrics in Prometheus's text format (`mlxq worker --metrics-port P`; docs/operations.md),
with vLLM's names and meanings where vLLM has them and an `mlxq:` prefix for the rest, each labelled
with the worker's name (`worker`) and its model (`model_name`, as vLLM names it).

What the decode loop pays for them is an addition or two a step: the step's duration and the tokens
it made go into histograms of this module's own (no lock: the loop is their one writer). Finished
jobs are counted on the bookkeeping thread, from the results it builds anyway; the gauges (running,
waiting, KV use, the prefix cache) are read from the scheduler's stats when Prometheus scrapes.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Callable, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from schemas import GenerationResult
from worker.redis_health import RedisHealth
from worker.scheduler import BatchScheduler

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class LoopHistogram:
    """A histogram written by one thread (the loop) without a lock, read at scrape time. `observe`
    takes a count: a decode step gives each sequence that decoded one inter-token interval."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.total = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += count
        self.total += value * count

    def family(self, name: str, documentation: str, labels: dict[str, str]) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, documentation, labels=list(labels))
        cumulative, buckets = 0, []
        for bound, count in zip((*map(str, self.buckets), "+Inf"), self.counts):
            cumulative += count
            buckets.append((bound, cumulative))
        family.add_metric(list(labels.values()), buckets, self.total)
        return family


class WorkerMetrics(Collector):
    def __init__(self, worker: str, model: Optional[str], read_gauges: Callable[[], dict[str, float]],
                 registry: Optional[CollectorRegistry] = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._labels = {"worker": worker, "model_name": model or ""}
        self._read_gauges = read_gauges
        self.steps = LoopHistogram(STEP_BUCKETS)
        self.inter_token = LoopHistogram(STEP_BUCKETS)
        names = list(self._labels)

        def counter(name: str, doc: str, *extra: str) -> Counter:
            return Counter(name, doc, names + list(extra), registry=self.registry)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, names, buckets=LATENCY_BUCKETS, registry=self.registry)

        labels = self._labels
        # Children bound once: the labels never change, and `labels()` per update costs microseconds.
        self._prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed").labels(**labels)
        self._generation_tokens = counter("vllm:generation_tokens", "Generation tokens processed").labels(**labels)
        self._success_family = counter("vllm:request_success", "Requests that finished, by finish reason",
                                       "finished_reason")
        self._failed_family = counter("mlxq:jobs_failed", "Jobs that failed, by error type", "error_type")
        self._cancelled = counter("mlxq:jobs_cancelled", "Jobs cancelled while running (not failures)").labels(**labels)
        self._draft_family = counter("vllm:spec_decode_num_draft_tokens",
                                     "Tokens proposed by speculative decoding's drafter", "drafter")
        self._accepted_family = counter("vllm:spec_decode_num_accepted_tokens",
                                        "Proposed tokens the model accepted", "drafter")
        self._drafted: dict[str, Any] = {}
        self._accepted: dict[str, Any] = {}
        self._success: dict[str, Any] = {}
        self._failed: dict[str, Any] = {}
        self._ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token (from the job's start)"
                               ).labels(**labels)
        self._e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end latency (from enqueue to result)"
                              ).labels(**labels)
        self._queue = histogram("vllm:request_queue_time_seconds", "Time a job waited in its queue").labels(**labels)
        self._lag = histogram("mlxq:bookkeeping_lag_seconds", "From a job's end in the engine to its result key"
                              ).labels(**labels)
        self.registry.register(self)
        self._lock = threading.Lock()  # the bookkeeping thread's updates against each other

    # --- the loop's side: no lock, a bucket search or two -----------------------------------
    def step(self, seconds: float, tokens: int) -> None:
        self.steps.observe(seconds)
        if tokens:
            self.inter_token.observe(seconds, tokens)

    # --- the bookkeeping thread's side ---------------------------------------------------
    def ended(self, result: GenerationResult, lag_s: float) -> None:
        with self._lock:
            self._lag.observe(lag_s)
            self._prompt_tokens.inc(result.usage.prompt_tokens)
            self._generation_tokens.inc(result.usage.completion_tokens)
            if result.status == "failed" and result.error is not None:
                self._child(self._failed, self._failed_family, "error_type", result.error.type).inc()
            elif result.status == "cancelled":
                self._cancelled.inc()
            else:
                for choice in result.choices:
                    reason = choice.finish_reason or "stop"
                    self._child(self._success, self._success_family, "finished_reason", reason).inc()
            if result.speculation is not None:
                drafter = result.speculation.drafter
                self._child(self._drafted, self._draft_family, "drafter", drafter).inc(result.speculation.proposed)
                self._child(self._accepted, self._accepted_family, "drafter", drafter).inc(
                    result.speculation.accepted)
            timings = result.timings
            if timings.ttft_s is not None:
                self._ttft.observe(timings.ttft_s)
            if timings.queue_s is not None:
                self._queue.observe(timings.queue_s)
            if timings.enqueued_at is not None and timings.finished_at is not None:
                self._e2e.observe(timings.finished_at - timings.enqueued_at)

    def _child(self, cache: dict[str, Any], family: Counter, label: str, value: str) -> Any:
        if value not in cache:
            cache[value] = family.labels(**self._labels, **{label: value})
        return cache[value]

    # --- scrape time --------------------------------------------------------------------
    def collect(self) -> Iterator[object]:
        labels = self._labels
        names, values = list(labels), list(labels.values())
        gauges = self._read_gauges()
        for name, doc, key in (("vllm:num_requests_running", "Jobs in the engine", "running"),
                               ("vllm:num_requests_waiting", "Jobs admitted, waiting for memory", "waiting"),
                               ("vllm:kv_cache_usage_perc", "KV-cache budget in use (1 = all)", "kv_usage"),
                               ("mlxq:sequences_running", "Sequences decoding", "sequences")):
            family = GaugeMetricFamily(name, doc, labels=names)
            family.add_metric(values, gauges.get(key, 0.0))
            yield family
        for name, doc, key in (("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                "prefix_cache_queries"),
                               ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                "prefix_cache_hits"),
                               ("mlxq:redis_reconnects", "Times the worker lost Redis", "redis_losses")):
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(values, gauges.get(key, 0.0))
            yield family
        yield self.steps.family("mlxq:engine_step_seconds", "Engine step duration", labels)
        yield self.inter_token.family("vllm:inter_token_latency_seconds", "Time between two tokens of a sequence",
                                      labels)

    def serve(self, port: int) -> None:
        """Serve /metrics on `port` from a thread of prometheus-client's own."""
        start_http_server(port, registry=self.registry)


def scheduler_gauges(scheduler: Optional[BatchScheduler], health: RedisHealth) -> dict[str, float]:
    """The gauges, read when Prometheus scrapes (its thread): the scheduler's state, the engine's
    prefix-cache counters, Redis's losses."""
    if scheduler is None:
        return {"redis_losses": health.losses}
    stats = scheduler.stats()
    prefix = stats.engine.prefix_cache
    return {"running": stats.jobs - stats.waiting, "waiting": stats.waiting, "sequences": stats.sequences,
            "kv_usage": stats.kv_reserved_bytes / stats.kv_budget_bytes if stats.kv_budget_bytes else 0.0,
            "prefix_cache_queries": float(prefix.get("prompt_tokens", 0)),
            "prefix_cache_hits": float(prefix.get("reused_tokens", 0)), "redis_losses": health.losses}
