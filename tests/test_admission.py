"""How many jobs a real worker process starts per loop turn: all it has room for when idle, at most
ADMIT_PER_TURN_WHILE_DECODING while sequences decode (starting jobs holds their next token back)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from producer import Client
from worker.batch_loop import ADMIT_PER_TURN_WHILE_DECODING
from tests.workers import stop, wait_for


def _jobs(count: int, max_tokens: int, offset: int) -> list[dict]:
    return [{"prompt_token_ids": [1 + (i + offset) % 250, 2, 3], "max_tokens": max_tokens, "ignore_eos": True}
            for i in range(count)]


def _largest_joins(steps: list[list[float]]) -> tuple[int, int]:
    """The most jobs that joined between two steps: into an idle engine, and into a decoding one."""
    into_idle = into_decoding = 0
    steps = [[0.0, 0], *steps]  # before its first step the engine was idle
    for (_, active, *_), (_, active_next, *_) in zip(steps, steps[1:]):
        joined = active_next - active
        if active == 0:
            into_idle = max(into_idle, joined)
        else:
            into_decoding = max(into_decoding, joined)
    return into_idle, into_decoding


def test_a_burst_joins_a_decoding_batch_a_few_dozen_jobs_a_turn(redis_url: str, tmp_path: Path) -> None:
    step_log = tmp_path / "steps.json"
    worker = subprocess.Popen(
        [sys.executable, "-m", "mlxq.bench.fake_worker", "--url", redis_url, "--name", "admission",
         "--max-num-seqs", "400", "--step-ms", "20", "--step-log", str(step_log), "admission"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client = Client(redis_url)
        first = client.submit_many(_jobs(150, 100, 0), queue="admission")  # into an idle worker
        wait_for(lambda: client.status(first[-1]) == "started", what="the first jobs to start")
        time.sleep(0.2)  # ~10 steps: they decode now
        burst = client.submit_many(_jobs(200, 3, 500), queue="admission")
        results = client.wait_many(first + burst, timeout=120)
        assert all(r.status == "finished" for r in results.values())
    finally:
        stop(worker)
    into_idle, into_decoding = _largest_joins(json.loads(step_log.read_text()))
    assert into_idle > ADMIT_PER_TURN_WHILE_DECODING  # an idle worker takes all it has room for
    assert 0 < into_decoding <= ADMIT_PER_TURN_WHILE_DECODING
