"""`GET /metrics`: the whole fleet in Prometheus's text format, read from Redis on each scrape
(producer/fleet_stats.py): queue depths, the oldest job's age, live workers by model, jobs and
sequences in flight, tokens/s, failures by type. Each worker's own metrics are on its
`--metrics-port` (worker/metrics.py); the names here differ from those, so that a Prometheus
scraping both never adds one number twice (docs/operations.md)."""

from __future__ import annotations

from collections.abc import Iterator
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from producer.api.gateway import gateway
from producer.fleet_stats import FleetSnapshot, aread_snapshot

__all__ = ["FleetCollector", "ops_access", "router"]

router = APIRouter()


def ops_access(request: Request) -> None:
    """The operator routes (/metrics, /dashboard) show the fleet, no job's content: open unless
    MLXQ_API_OPS_REQUIRE_KEY, then they take any API key (`Authorization: Bearer`), as other routes do."""
    gw = gateway(request)
    if gw.settings.ops_require_key:
        gw.auth.tenant(request.headers.get("authorization"))


class FleetCollector(Collector):
    """One snapshot's metric families (a registry of its own per scrape)."""

    def __init__(self, snapshot: FleetSnapshot) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snapshot = self.snapshot
        queue_rows = (("mlxq:queue_depth", "Jobs waiting in the queue", lambda q: q.depth),
                      ("mlxq:queue_oldest_job_age_seconds", "How long the job at the queue's head has waited",
                       lambda q: q.oldest_age_s or 0.0),
                      ("mlxq:queue_jobs_started", "Jobs of the queue taken by a worker and not ended",
                       lambda q: q.started),
                      ("mlxq:queue_jobs_failed", "Jobs in the queue's failed registry", lambda q: q.failed),
                      ("mlxq:queue_unserved", "1 while jobs wait in the queue and no live worker listens on it",
                       lambda q: 1 if q.unserved else 0))
        for name, doc, read in queue_rows:
            family = GaugeMetricFamily(name, doc, labels=["queue"])
            for queue in snapshot.queues:
                family.add_metric([queue.name], float(read(queue)))
            yield family

        yield GaugeMetricFamily("mlxq:queues_registered", "Queues in RQ's registry (rq:queues), listed above or not",
                                value=snapshot.queues_registered)
        yield GaugeMetricFamily("mlxq:queues_with_jobs", "Registered queues holding jobs, waiting or taken (the "
                                "deepest are listed above)", value=snapshot.queues_with_jobs)
        live = GaugeMetricFamily("mlxq:fleet_workers_live", "Live workers, by model", labels=["model_name"])
        for model, count in snapshot.models.items():
            live.add_metric([model], count)
        yield live
        labels = ["worker", "model_name"]
        worker_rows = (("mlxq:fleet_jobs_in_flight", "Jobs a live worker is running", lambda w: w.running),
                       ("mlxq:fleet_sequences_running", "Sequences a live worker is decoding", lambda w: w.sequences),
                       ("mlxq:fleet_max_num_seqs", "A live worker's decode batch limit", lambda w: w.max_num_seqs),
                       ("mlxq:fleet_generation_tokens_per_second",
                        "Completion tokens per second of the jobs a worker ended in the last minute",
                        lambda w: w.tokens_per_s_1m))
        for name, doc, read in worker_rows:
            family = GaugeMetricFamily(name, doc, labels=labels)
            for worker in snapshot.workers:
                family.add_metric([worker.name, worker.model], float(read(worker)))
            yield family
        hit_rate = GaugeMetricFamily("mlxq:fleet_prefix_cache_hit_rate", "Prompt tokens found in a worker's prefix "
                                     "cache, over those looked up", labels=labels)
        finished = CounterMetricFamily("mlxq:fleet_jobs_finished", "Jobs a live worker ended without error, since "
                                       "it started", labels=labels)
        failed = CounterMetricFamily("mlxq:fleet_jobs_failed", "Jobs a live worker failed, by error type, since it "
                                     "started", labels=[*labels, "error_type"])
        cancelled = CounterMetricFamily("mlxq:fleet_jobs_cancelled", "Jobs a live worker ended cancelled (not "
                                        "failures), since it started", labels=labels)
        for worker in snapshot.workers:
            if worker.prefix_cache_hit_rate is not None:
                hit_rate.add_metric([worker.name, worker.model], worker.prefix_cache_hit_rate)
            finished.add_metric([worker.name, worker.model], worker.jobs_finished)
            cancelled.add_metric([worker.name, worker.model], worker.jobs_cancelled)
            for error_type, count in worker.failures.items():
                failed.add_metric([worker.name, worker.model, error_type], count)
        yield from (hit_rate, finished, failed, cancelled)


@router.get("/metrics", include_in_schema=False, dependencies=[Depends(ops_access)])
async def fleet_metrics(request: Request) -> Response:
    snapshot = await aread_snapshot(gateway(request).client.connection)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(snapshot))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
