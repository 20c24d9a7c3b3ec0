"""The operator page in headless Chromium (Debian's), with two fake-engine workers running and jobs
flowing: both workers shown, and the charts have points. The screenshot is kept in the test's tmp dir."""

from __future__ import annotations

import threading

import pytest
import redis

from producer import Client
from tests.browser import chromium_page
from tests.gateway import running_gateway, wait_live
from tests.workers import start_fake_worker, stop

pytestmark = pytest.mark.slow

def flow_jobs(url: str, tokens: dict[str, int], stop_flowing: threading.Event) -> None:
    """Jobs for each model (of `tokens[model]` tokens each), a few at a time, until told to stop."""
    client = Client(url)
    try:
        while not stop_flowing.is_set():
            ids = [client.submit({"model": m, "prompt_token_ids": [5, 6], "max_tokens": n, "ignore_eos": True})
                   for m, n in tokens.items() for _ in range(3)]
            client.wait_many(ids, timeout=60)
    finally:
        client.close()


def test_dashboard_shows_the_fleet_and_its_charts_have_points(redis_url, tmp_path):
    conn = redis.Redis.from_url(redis_url)
    workers = [start_fake_worker(redis_url, name=name, env={"MLXQ_ALIAS": alias}, step_delay_s=0.01)
               for name, alias in (("page-a", "alpha"), ("page-b", "beta"))]
    stop_flowing = threading.Event()
    producer = threading.Thread(target=flow_jobs, args=(redis_url, {"alpha": 12, "beta": 24}, stop_flowing))
    try:
        for name in ("page-a", "page-b"):
            wait_live(conn, name)
        Client(redis_url).submit({"model": "alpha", "prompt_token_ids": [5, 300], "max_tokens": 2})  # one failure
        producer.start()
        with running_gateway(redis_url, history_interval_s=0.5) as base, chromium_page() as page:
            page.goto(base.removesuffix("/v1") + "/dashboard")
            # Each worker's tokens/s line has points, and the TTFT chart has some.
            page.wait_for_function(
                """() => {
                    const tokens = document.getElementById('chart-tokens').data || [];
                    const ttft = document.getElementById('chart-ttft').data || [];
                    return tokens.length === 2 && tokens.every(t => t.x.length >= 3) && ttft[0].x.length >= 2;
                }""", timeout=60_000)
            workers_text = page.inner_text("#workers")
            models_text = page.inner_text("#models")
            failures_text = page.inner_text("#failures")
            drawn = page.evaluate("""() => ['chart-tokens', 'chart-ttft', 'chart-jobs'].map(
                id => document.querySelectorAll('#' + id + ' .scatterlayer .trace .points path').length)""")
            names = page.evaluate("() => document.getElementById('chart-tokens').data.map(t => t.name)")
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
    finally:
        stop_flowing.set()
        if producer.is_alive():
            producer.join(timeout=60)
        outs = [stop(w) for w in workers]
    assert all(w.returncode == 0 for w in workers), outs
    assert "page-a" in workers_text and "page-b" in workers_text
    assert "alpha" in models_text and "beta" in models_text
    assert "InvalidRequest" in failures_text
    assert sorted(names) == ["page-a (alpha)", "page-b (beta)"]
    assert all(count >= 2 for count in drawn), drawn  # marker points drawn in each chart's SVG
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
