"""Priorities: a priority maps to ordered queues as `rq worker high default low` orders them, through the
producer, the CLI and the worker (the gateway's side: tests/test_gateway.py)."""

from __future__ import annotations

import pytest
import redis

from producer import Client
from schemas import keys
from tests.workers import start_fake_worker, stop
from worker.settings import WorkerSettings


def test_worker_queues_by_priority() -> None:
    assert WorkerSettings(model="org/qwen").default_queues() == ["mlxq:qwen", "mlxq"]
    settings = WorkerSettings.from_env({"MLXQ_MODEL": "org/qwen", "MLXQ_PRIORITIES": "high,default,low"})
    assert settings.default_queues() == ["mlxq:qwen@high", "mlxq@high", "mlxq:qwen", "mlxq", "mlxq:qwen@low", "mlxq@low"]
    for bad in ("high,low", "high,default,high", "hi gh,default"):
        with pytest.raises(ValueError, match="MLXQ_PRIORITIES"):
            WorkerSettings.from_env({"MLXQ_PRIORITIES": bad})
    assert keys.priority_queue("mlxq:qwen", None) == keys.priority_queue("mlxq:qwen", "default") == "mlxq:qwen"


@pytest.mark.slow
def test_a_worker_takes_higher_priorities_first(redis_url: str, redis_conn: redis.Redis) -> None:
    client = Client(redis_url)
    order = {priority: client.submit_many([{"prompt": f"{priority}{i}", "model": "fake", "max_tokens": 2}
                                           for i in range(3)], priority=priority)
             for priority in ("low", "default", "high")}  # enqueued lowest first, before any worker runs
    worker = start_fake_worker(redis_url, "--model", "fake", "--priorities", "high,default,low", "--max-num-seqs", "1")
    try:
        results = client.wait_many([job_id for ids in order.values() for job_id in ids], timeout=60)
    finally:
        out = stop(worker)
    assert "mlxq:fake@high, mlxq@high, mlxq:fake, mlxq, mlxq:fake@low, mlxq@low" in out
    started = {p: [results[i].timings.started_at for i in ids] for p, ids in order.items()}
    assert max(started["high"]) < min(started["default"]) and max(started["default"]) < min(started["low"])
    assert all(r.status == "finished" for r in results.values())


def test_cli_submit_priority(redis_url: str, redis_conn: redis.Redis, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.test_producer import cli

    assert cli("submit", "--url", redis_url, "--prompt", "hi", "--model", "m", "--priority", "high") == 0
    job_id = capsys.readouterr().out.strip()
    assert redis_conn.lrange("rq:queue:mlxq:m@high", 0, -1) == [job_id.encode()]
    assert cli("submit", "--url", redis_url, "--prompt", "hi", "--priority", "urgent") == 2
    assert "priority" in capsys.readouterr().err
