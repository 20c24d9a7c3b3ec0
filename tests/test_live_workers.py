"""Workers that come and go: the producer sees which models are served now (`models()`), can refuse to
enqueue for a queue nobody listens on (`require_live_worker`), and a wait can say that nobody has
listened for N s (`NoLiveWorker`), while the job itself waits in its queue until a worker comes."""

from __future__ import annotations

import asyncio
import time

import pytest

from producer import AsyncClient, Client, NoLiveWorker
from schemas import keys
from tests.gateway import announce
from tests.workers import start_fake_worker, stop, wait_for
from worker.presence import PresencePublisher
from worker.settings import WorkerSettings
from worker.engines.fake import fake_token

REQUEST = {"model": "m", "prompt_token_ids": [1, 2, 3], "max_tokens": 4}


def test_models_lists_what_live_workers_serve_and_forgets_expired_ones(redis_url, redis_conn):
    client = Client(redis_url)
    assert client.models() == []
    announce(redis_conn, "w1", "m")
    announce(redis_conn, "w2", "m")
    announce(redis_conn, "w3", "other", ttl=1)
    models = {m.name: m for m in client.models()}
    assert models["m"].workers == 2 and models["m"].queues == {"mlxq:m", "mlxq"}
    assert set(models) == {"m", "other"}
    wait_for(lambda: [m.name for m in client.models()] == ["m"], timeout=5, what="the expired worker to drop out")

    async def aio() -> list[str]:
        async with AsyncClient(redis_url) as aclient:
            return [m.name for m in await aclient.models()]
    assert asyncio.run(aio()) == ["m"]
    client.close()


def test_a_worker_with_a_short_ttl_does_not_drop_a_longer_lived_worker_from_the_list(redis_url, redis_conn):
    """Each worker refreshes its own entry at its own pace: one whose heartbeat TTL is 8 s leaves in the
    list a worker with a 600 s TTL that last refreshed 30 s ago (its entry has not expired)."""
    announce(redis_conn, "slow-beat", "m", ttl=600)
    redis_conn.zadd(keys.WORKERS_KEY, {"slow-beat": time.time() - 30})
    settings = WorkerSettings(engine="fake", heartbeat_interval_s=1)
    PresencePublisher(redis_conn, "fast-beat", settings, ["mlxq:other"], kind="fake").refresh(running=0, sequences=0)
    client = Client(redis_url)
    assert {m.name: m.workers for m in client.models()} == {"m": 1}
    client.close()


def test_require_live_worker_refuses_a_queue_nobody_listens_on_and_enqueues_nothing(redis_url, redis_conn):
    client = Client(redis_url)
    announce(redis_conn, "w1", "other")
    with pytest.raises(NoLiveWorker, match=r"no live worker listens on queue 'mlxq:m' \(model 'm'\); models served now: "
                                           "other. Nothing was enqueued") as caught:
        client.submit(REQUEST, require_live_worker=True)
    assert caught.value.queue == "mlxq:m"
    with pytest.raises(NoLiveWorker):
        client.submit_many([{**REQUEST, "model": "other"}, REQUEST], require_live_worker=True)
    assert redis_conn.llen("rq:queue:mlxq:m") == 0 and redis_conn.llen("rq:queue:mlxq:other") == 0
    # Without the flag the job waits in its queue, as before.
    job_id = client.submit(REQUEST, ttl=60)
    assert client.status(job_id) == "queued"
    announce(redis_conn, "w2", "m")
    assert client.submit(REQUEST, require_live_worker=True)

    async def aio() -> None:
        async with AsyncClient(redis_url) as aclient:
            await aclient.submit(REQUEST, require_live_worker=True)
            with pytest.raises(NoLiveWorker):
                await aclient.submit({**REQUEST, "model": "nobody"}, require_live_worker=True)
    asyncio.run(aio())
    client.close()


def test_a_wait_can_give_up_on_a_queue_nobody_serves_without_touching_the_job(redis_url, redis_conn):
    client = Client(redis_url)
    job_id = client.submit(REQUEST)
    started = time.monotonic()
    with pytest.raises(NoLiveWorker, match=r"no live worker for queue 'mlxq:m' for \d+ s \(1 job") as caught:
        client.wait(job_id, timeout=30, no_worker_timeout=1)
    assert 1 <= time.monotonic() - started < 10
    assert caught.value.job_ids == (job_id,) and client.status(job_id) == "queued"

    async def aio() -> None:
        async with AsyncClient(redis_url) as aclient:
            with pytest.raises(NoLiveWorker):
                await aclient.wait(job_id, timeout=30, no_worker_timeout=1)
    asyncio.run(aio())
    # A live worker on the queue: the wait goes on (and times out as asked, not with NoLiveWorker).
    announce(redis_conn, "w1", "m")
    from producer import WaitTimeout
    with pytest.raises(WaitTimeout):
        client.wait(job_id, timeout=3, no_worker_timeout=1)
    client.close()


@pytest.mark.slow
def test_a_job_for_a_model_nobody_serves_waits_and_runs_when_a_worker_comes(redis_url):
    client = Client(redis_url)
    job_id = client.submit(REQUEST, ttl=120)
    time.sleep(1)
    assert client.status(job_id) == "queued"
    worker = start_fake_worker(redis_url, "--alias", "m", name="late")
    try:
        result = client.wait(job_id, timeout=60, no_worker_timeout=30)
    finally:
        out = stop(worker)
    assert result.status == "finished", out
    assert result.choices[0].token_ids == [fake_token([1, 2, 3], k) for k in range(4)]
    client.close()


def test_the_first_result_written_stays(redis_conn):
    """A late writer (a worker cut off while another ran the job, a sweep) never replaces a result."""
    from schemas import GenerationResult
    from worker.publish import Publication, publish_results

    first = GenerationResult(id="j1", status="finished", worker="a")
    late = GenerationResult(id="j1", status="failed", worker="b")
    publish_results(redis_conn, [Publication(first, 60)])
    publish_results(redis_conn, [Publication(late, 60)])
    assert GenerationResult.model_validate_json(redis_conn.get(keys.result_key("j1"))).worker == "a"
