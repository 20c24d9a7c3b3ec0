"""`mlxq stats` on a live fleet of two fake-engine workers: queues, workers, tokens/s, failures."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import redis

from producer import Client
from producer.fleet_stats import read_snapshot
from tests.gateway import wait_live
from tests.workers import start_fake_worker, stop, wait_for

pytestmark = pytest.mark.slow


def mlxq(url: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mlxq", "stats", "--url", url, *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": "200"})


def test_stats_shows_queues_workers_rates_and_failures(redis_url):
    conn = redis.Redis.from_url(redis_url)
    workers = [start_fake_worker(redis_url, name=name, env={"MLXQ_ALIAS": alias}, step_delay_s=0.01)
               for name, alias in (("stats-a", "alpha"), ("stats-b", "beta"))]
    client = Client(redis_url)
    try:
        for name in ("stats-a", "stats-b"):
            wait_live(conn, name)
        ok = [client.submit({"model": model, "prompt_token_ids": [5, 6], "max_tokens": 10, "ignore_eos": True})
              for model in ("alpha", "beta") for _ in range(3)]
        bad = client.submit({"model": "alpha", "prompt_token_ids": [5, 300], "max_tokens": 4})  # outside the vocabulary
        results = client.wait_many([*ok, bad], timeout=60)
        assert [results[j].status for j in ok] == ["finished"] * 6 and results[bad].status == "failed"
        # A queue nobody serves, with a job waiting: its depth and the age of its oldest job.
        client.submit({"prompt_token_ids": [5], "max_tokens": 2}, queue="mlxq:nobody")
        time.sleep(0.3)
        long = client.submit({"model": "beta", "prompt_token_ids": [9], "max_tokens": 400, "ignore_eos": True})
        wait_for(lambda: client.status(long) == "started", what="a running job")
        wait_for(lambda: read_snapshot(conn).in_flight == 1, what="the worker's heartbeat saying so", timeout=10)

        shown = mlxq(redis_url, "--json")
        table = mlxq(redis_url)
        # SIGINT as a terminal's Ctrl-C sends it: a test run started in the background (`pytest ... &` in
        # a script) hands its children SIGINT ignored, and Python then installs no KeyboardInterrupt.
        watch = subprocess.Popen([sys.executable, "-m", "mlxq", "stats", "--url", redis_url, "--watch", "--json",
                                  "--interval", "0.2"], stdout=subprocess.PIPE, text=True,
                                 preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        assert watch.stdout is not None
        first = [watch.stdout.readline() for _ in range(3)]  # three refreshes, however long its start takes
        watch.send_signal(signal.SIGINT)
        rest, _ = watch.communicate(timeout=30)
        watched = "".join(first) + rest
    finally:
        client.close()
        outs = [stop(w) for w in workers]
    assert all(w.returncode == 0 for w in workers), outs
    assert shown.returncode == 0, shown.stderr
    report = json.loads(shown.stdout)
    queues = {q["name"]: q for q in report["queues"]}
    assert queues["mlxq:nobody"]["depth"] == 1 and queues["mlxq:nobody"]["oldest_age_s"] >= 0.3
    assert queues["mlxq:alpha"]["failed"] == 1 and queues["mlxq:alpha"]["depth"] == 0
    workers_by_name = {w["name"]: w for w in report["workers"]}
    assert set(workers_by_name) == {"stats-a", "stats-b"}
    assert workers_by_name["stats-a"]["model"] == "alpha" and workers_by_name["stats-b"]["model"] == "beta"
    assert workers_by_name["stats-a"]["failures"] == {"InvalidRequest": 1}
    assert workers_by_name["stats-a"]["jobs_finished"] == 3 and workers_by_name["stats-a"]["tokens"] == 30
    assert workers_by_name["stats-b"]["running"] == 1 and workers_by_name["stats-b"]["sequences"] == 1
    # 30 tokens in the last minute: 0.5 tokens/s (the window is a minute long, whatever the run took)
    assert workers_by_name["stats-a"]["tokens_per_s_1m"] == pytest.approx(0.5)
    assert report["failures"] == {"InvalidRequest": 1} and report["models"] == {"alpha": 1, "beta": 1}
    assert report["in_flight"] == 1

    assert table.returncode == 0, table.stderr
    for text in ("stats-a", "stats-b", "alpha", "beta", "mlxq:nobody", "InvalidRequest", "Live workers (2)"):
        assert text in table.stdout, (text, table.stdout)
    lines = [json.loads(line) for line in watched.splitlines() if line.strip()]
    assert len(lines) >= 3 and lines[-1]["taken_at"] > lines[0]["taken_at"]
    assert watch.returncode == 0
