"""The gateway's fleet `/metrics`, scraped with jobs flowing through two fake-engine workers, and the
history the `/dashboard` charts draw (one sample per interval whatever the number of gateways)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import redis
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from producer import Client
from producer.api.app import create_app
from producer.api.settings import GatewaySettings
from producer.done_listener import stop_reader
from producer.fleet_history import HistorySampler, read_history
from schemas import keys
from tests.gateway import key_entry, running_gateway, wait_live
from tests.workers import start_fake_worker, stop, wait_for


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(scraped: dict, name: str, **labels: str) -> float:
    return scraped[(name, tuple(sorted(labels.items())))]


@pytest.mark.slow
def test_fleet_metrics_from_redis_on_each_scrape(redis_url):
    conn = redis.Redis.from_url(redis_url)
    workers = [start_fake_worker(redis_url, name=name, env={"MLXQ_ALIAS": alias}, step_delay_s=0.01)
               for name, alias in (("metrics-a", "alpha"), ("metrics-b", "beta"))]
    client = Client(redis_url)
    try:
        with running_gateway(redis_url) as base:
            root = base.removesuffix("/v1")
            empty = httpx.get(f"{root}/metrics", timeout=10)
            for name in ("metrics-a", "metrics-b"):
                wait_live(conn, name)
            ok = [client.submit({"model": m, "prompt_token_ids": [5, 6], "max_tokens": 6, "ignore_eos": True})
                  for m in ("alpha", "alpha", "beta")]
            bad = client.submit({"model": "beta", "prompt_token_ids": [5, 300], "max_tokens": 4})
            client.wait_many([*ok, bad], timeout=60)
            for _ in range(2):
                client.submit({"prompt_token_ids": [5], "max_tokens": 2}, queue="mlxq:nobody")
            long = client.submit({"model": "alpha", "prompt_token_ids": [9], "max_tokens": 500, "ignore_eos": True})
            wait_for(lambda: client.status(long) == "started", what="a running job")
            wait_for(lambda: b'"running":1' in (conn.get(keys.worker_key("metrics-a")) or b""), timeout=10,
                     what="the worker's heartbeat entry saying so")
            response = httpx.get(f"{root}/metrics", timeout=10)
    finally:
        client.close()
        outs = [stop(w) for w in workers]
    assert all(w.returncode == 0 for w in workers), outs
    assert empty.status_code == 200
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    scraped = samples(response.text)
    a, b = {"worker": "metrics-a", "model_name": "alpha"}, {"worker": "metrics-b", "model_name": "beta"}
    assert value(scraped, "mlxq:queue_depth", queue="mlxq:nobody") == 2
    assert value(scraped, "mlxq:queue_oldest_job_age_seconds", queue="mlxq:nobody") > 0
    assert value(scraped, "mlxq:queue_depth", queue="mlxq:alpha") == 0
    assert value(scraped, "mlxq:queue_jobs_started", queue="mlxq:alpha") == 1
    assert value(scraped, "mlxq:queue_jobs_failed", queue="mlxq:beta") == 1
    assert value(scraped, "mlxq:fleet_workers_live", model_name="alpha") == 1
    assert value(scraped, "mlxq:fleet_workers_live", model_name="beta") == 1
    assert value(scraped, "mlxq:fleet_jobs_in_flight", **a) == 1
    assert value(scraped, "mlxq:fleet_jobs_in_flight", **b) == 0
    assert value(scraped, "mlxq:fleet_sequences_running", **a) == 1
    assert value(scraped, "mlxq:fleet_jobs_finished_total", **a) == 2
    assert value(scraped, "mlxq:fleet_jobs_failed_total", **b, error_type="InvalidRequest") == 1
    assert value(scraped, "mlxq:fleet_generation_tokens_per_second", **a) == pytest.approx(12 / 60)
    assert value(scraped, "mlxq:fleet_max_num_seqs", **b) == 32


def test_ops_routes_take_a_key_when_asked(redis_url):
    with running_gateway(redis_url, api_keys=key_entry("ops", "sk-ops-secret"), ops_require_key=True) as base:
        root = base.removesuffix("/v1")
        assert httpx.get(f"{root}/metrics", timeout=10).status_code == 401
        assert httpx.get(f"{root}/dashboard/data", timeout=10).status_code == 401
        headers = {"Authorization": "Bearer sk-ops-secret"}
        assert httpx.get(f"{root}/metrics", headers=headers, timeout=10).status_code == 200
        assert httpx.get(f"{root}/dashboard/data", headers=headers, timeout=10).status_code == 200
        page = httpx.get(f"{root}/dashboard", timeout=10)  # the page holds no data: it asks with the key
        assert page.status_code == 200 and "plotly.min.js" in page.text
        script = httpx.get(f"{root}/dashboard/plotly.min.js", timeout=30)
        assert script.status_code == 200 and "plotly.js" in script.text[:2000]


def test_one_history_sample_per_interval_whatever_the_number_of_gateways(redis_url):
    async def scenario() -> tuple[list[bool], list[bool], int, list]:
        connection = aioredis.Redis.from_url(redis_url)
        replicas = [HistorySampler(connection, interval_s=0.4, window_s=60) for _ in range(3)]
        await asyncio.sleep(0.4 - time.time() % 0.4 + 0.02)  # early in an interval
        first = [await r.sample_once() for r in replicas]
        await asyncio.sleep(0.4)
        second = await asyncio.gather(*(r.sample_once() for r in replicas))
        entries = await connection.xlen(keys.HISTORY_KEY)
        history = await read_history(connection, 60)
        await connection.aclose()
        return first, list(second), entries, history

    first, second, entries, history = asyncio.run(scenario())
    assert sorted(first) == [False, False, True] and sorted(second) == [False, False, True]
    assert entries == 2 and len(history) == 2 and history[0].t < history[1].t
    assert history[0].tokens_per_s == {} and history[0].ttft_jobs == 0
    raw = redis.Redis.from_url(redis_url).xrange(keys.HISTORY_KEY)
    assert all(json.loads(fields[b"data"])["queued"] == 0 for _, fields in raw)


def test_the_gateway_stops_when_a_cancel_of_its_upkeep_turns_into_a_redis_error(redis_url, monkeypatch):
    """An upkeep task whose cancel comes out of a Redis call as a Redis error (the history sampler logs
    those and reads on) still ends: the gateway's shutdown cancels each upkeep task until it ends. A
    single cancel left the shutdown waiting on it for good, as it once did on the batch driver."""
    turned: list[bool] = []

    async def sample_once(self: HistorySampler) -> bool:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if not turned:
                turned.append(True)
                raise redis.TimeoutError("Timeout reading from socket") from None
            raise
        return True

    monkeypatch.setattr(HistorySampler, "sample_once", sample_once)

    async def start_and_stop() -> None:
        app = create_app(GatewaySettings(redis_url=redis_url))
        async with app.router.lifespan_context(app):
            await asyncio.sleep(0.2)

    async def stopped_within(seconds: float) -> bool:
        serving = asyncio.create_task(start_and_stop())
        done, _ = await asyncio.wait({serving}, timeout=seconds)
        await stop_reader(serving)  # a second cancel, from here, ends a shutdown that hung
        return bool(done)

    assert asyncio.run(stopped_within(10)), "the gateway's lifespan did not end within 10 s"
    assert turned == [True]
