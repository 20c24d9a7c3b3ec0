"""A worker's Prometheus metrics, scraped from a real worker process on the fake engine."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlxq.redis_server import free_port
from producer import Client
from tests.workers import start_fake_worker, stop, wait_for

pytestmark = pytest.mark.slow


def scrape(port: int) -> dict[str, list]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def value(samples: list, name: str, **labels: str) -> float:
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_a_worker_serves_vllm_named_metrics_labelled_with_worker_and_model(redis_url):
    port = free_port()
    worker = start_fake_worker(redis_url, "--metrics-port", str(port), name="metered",
                               env={"MLXQ_ALIAS": "fake"}, step_delay_s=0.01)
    client = Client(redis_url)
    try:
        ok = [client.submit({"prompt_token_ids": [5, 6], "max_tokens": 7, "temperature": 0, "ignore_eos": True})
              for _ in range(5)]
        bad = client.submit({"prompt_token_ids": [5, 300], "max_tokens": 7})  # outside the fake vocabulary
        results = client.wait_many([*ok, bad], timeout=60)
        long = client.submit({"prompt_token_ids": [9], "max_tokens": 500, "ignore_eos": True})
        # RQ marks a job started before the engine has it: the gauge is waited for, not the status.
        wait_for(lambda: value(scrape(port)["vllm:num_requests_running"], "vllm:num_requests_running",
                               worker="metered", model_name="fake") == 1, timeout=30, interval=0.1,
                 what="the running job in the engine's gauge")
        metrics = scrape(port)
        assert client.status(long) == "started"
    finally:
        out = stop(worker)
    assert worker.returncode == 0, out
    labels = {"worker": "metered", "model_name": "fake"}
    assert all(results[j].status == "finished" for j in ok) and results[bad].status == "failed"
    assert value(metrics["vllm:request_success"], "vllm:request_success_total", finished_reason="length",
                 **labels) == 5
    assert value(metrics["vllm:generation_tokens"], "vllm:generation_tokens_total", **labels) == 35
    assert value(metrics["vllm:prompt_tokens"], "vllm:prompt_tokens_total", **labels) == 10
    assert value(metrics["mlxq:jobs_failed"], "mlxq:jobs_failed_total", error_type="InvalidRequest", **labels) == 1
    assert value(metrics["vllm:num_requests_running"], "vllm:num_requests_running", **labels) == 1
    assert value(metrics["vllm:time_to_first_token_seconds"], "vllm:time_to_first_token_seconds_count",
                 **labels) == 5
    assert value(metrics["mlxq:engine_step_seconds"], "mlxq:engine_step_seconds_count", **labels) >= 8
    assert value(metrics["vllm:inter_token_latency_seconds"], "vllm:inter_token_latency_seconds_count",
                 **labels) >= 35
    for name in ("vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "mlxq:redis_reconnects",
                 "mlxq:bookkeeping_lag_seconds", "vllm:num_requests_waiting"):
        assert name in metrics, name


def test_speculations_proposed_and_accepted_tokens_are_counted_per_drafter():
    """In process (the counters' arithmetic): a worker process speculating is test_speculative_worker.py's."""
    from prometheus_client import generate_latest

    from schemas import GenerationResult
    from worker.metrics import WorkerMetrics

    metrics = WorkerMetrics("w", "m", lambda: {})
    for proposed, accepted in ((12, 9), (5, 0)):
        metrics.ended(GenerationResult(id="j", status="finished",
                                       speculation={"drafter": "ngram", "proposed": proposed, "accepted": accepted}),
                      0.0)
    metrics.ended(GenerationResult(id="k", status="finished"), 0.0)
    families = {f.name: f.samples for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}
    labels = {"worker": "w", "model_name": "m", "drafter": "ngram"}
    assert value(families["vllm:spec_decode_num_draft_tokens"], "vllm:spec_decode_num_draft_tokens_total",
                 **labels) == 17
    assert value(families["vllm:spec_decode_num_accepted_tokens"], "vllm:spec_decode_num_accepted_tokens_total",
                 **labels) == 9
