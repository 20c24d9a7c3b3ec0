"""A Sentinel failover under load, on real processes: a primary, two replicas and three sentinels; three
fake-engine workers, two producers and the gateway, all given the `redis+sentinel://` URL. The primary
is killed with SIGKILL while jobs run and producers keep submitting; everything follows the new primary,
every submit that returned an id ends in a result, and no result, once read, is replaced by another."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from producer import Client, MlxqError
from producer.presence import read_live
from tests.gateway import running_gateway
from tests.sentinel import sentinel_set
from tests.workers import start_fake_worker, stop, wait_for
from worker.engines.fake import fake_token

pytestmark = pytest.mark.slow

MAX_TOKENS = 150  # 4.5 s a job at the workers' step delay: the primary dies with ~100 of them running
TARGET_JOBS = 100


MODEL = "fleet"  # the workers' alias: what the gateway routes by


def request(index: int) -> dict:
    prompt = [1 + index % 250, 7, index // 250 + 1]  # every token within the fake engine's vocabulary
    return {"model": MODEL, "prompt_token_ids": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}


def expected_tokens(index: int) -> list[int]:
    return [fake_token(request(index)["prompt_token_ids"], k) for k in range(MAX_TOKENS)]


class Producers:
    """Threads that submit durable jobs until told to stop (or a bound), keeping the ids that came back."""

    def __init__(self, url: str, threads: int = 2, limit: int = 220, deadline_s: float = 60) -> None:
        self.url, self.limit, self.deadline = url, limit, time.monotonic() + deadline_s
        self.submitted: dict[str, int] = {}
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._next = 0
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def start(self) -> "Producers":
        for thread in self._threads:
            thread.start()
        return self

    def count(self) -> int:
        with self._lock:
            return len(self.submitted)

    def _run(self) -> None:
        client = Client(self.url)
        try:
            while not self._stop.is_set() and time.monotonic() < self.deadline:
                with self._lock:
                    if self._next >= self.limit:
                        return
                    index, self._next = self._next, self._next + 1
                try:
                    job_id = client.submit(request(index), durable=True, retry=3)
                except MlxqError as exc:  # during the failover: this submit returned no id
                    with self._lock:
                        self.errors.append(f"{type(exc).__name__}: {exc}")
                    time.sleep(0.2)
                    continue
                with self._lock:
                    self.submitted[job_id] = index
                time.sleep(0.01)
        finally:
            client.close()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)


def test_a_failover_under_load_loses_no_submitted_job_and_replaces_no_result():
    with sentinel_set() as redis_set:
        url = redis_set.url
        env = {"MLXQ_DURABLE_RESULTS": "1", "MLXQ_HEARTBEAT_INTERVAL_S": "1"}
        workers = [start_fake_worker(url, "--alias", MODEL, "--max-num-seqs", "40", name=f"w{i}",
                                     step_delay_s=0.03, env=env) for i in range(3)]
        producers = Producers(url)
        client = Client(url)
        outputs: list[str] = []
        try:
            wait_for(lambda: len(read_live(client.connection)) == 3, timeout=60, what="three live workers")
            with running_gateway(url, durable_replicas=1) as base:  # a 200 means a replica has the job
                producers.start()
                wait_for(lambda: sum(w.running for w in read_live(client.connection)) >= TARGET_JOBS * 0.9,
                         timeout=60, what=f"~{TARGET_JOBS} jobs running")
                running = sum(w.running for w in read_live(client.connection))
                old = redis_set.crash_primary()
                killed_at = time.monotonic()
                new = redis_set.wait_for_new_primary(old)
                failover_s = time.monotonic() - killed_at
                # The gateway follows it too: a job through it after the failover.
                with httpx.Client(base_url=base, timeout=30) as http:
                    job = None
                    for _ in range(100):  # bounded: the gateway reconnects within a few tries
                        reply = http.post("/jobs", json=request(5000))
                        if reply.status_code == 200:
                            job = reply.json()["id"]
                            break
                        time.sleep(0.2)
                    assert job is not None, f"the gateway never took a job after the failover: {reply.text}"
                    try:
                        wait_for(lambda: http.get(f"/jobs/{job}").json()["status"] == "finished", timeout=60,
                                 interval=0.2, what="the gateway's job")
                    except AssertionError:
                        print("gateway job", job, client.status(job), client.connection.hgetall(f"rq:job:{job}"),
                              client.connection.keys("rq:queue:*"), client.connection.llen("rq:queue:mlxq:fleet"))
                        raise
                    assert http.get(f"/jobs/{job}").json()["result"]["choices"][0]["token_ids"] == \
                        expected_tokens(5000)
                wait_for(lambda: producers.count() >= TARGET_JOBS + 40, timeout=60, what="submits after the failover")
                producers.stop()
            submitted = dict(producers.submitted)
            first = client.wait_many(submitted, timeout=180)
            print(f"primary {old} -> {new} in {failover_s:.1f} s with {running} jobs running; "
                  f"{len(submitted)} submitted, {len(producers.errors)} submits refused meanwhile")
            for job_id, index in submitted.items():
                assert first[job_id].status == "finished", (job_id, first[job_id])
                assert first[job_id].choices[0].token_ids == expected_tokens(index)
            time.sleep(12)  # past every heartbeat TTL and sweep: any late writer has had its chance
            later = {job_id: client.result(job_id) for job_id in submitted}
            replaced = [job_id for job_id in submitted if later[job_id] != first[job_id]]
            assert not replaced, f"results replaced after they were read: {replaced[:5]}"
            ran_twice = [j for j in submitted if client.connection.xlen(f"rq:results:{j}") > 1]
            print(f"{len(ran_twice)} job(s) ran twice (a start lost in the failover, or taken by a sweep); "
                  "the first result stayed")
        finally:
            producers.stop()
            client.close()
            outputs = [stop(w) for w in workers]
            for i, out in enumerate(outputs):  # what diagnosing a failure needs, without the routine lines
                lines = [line for line in out.splitlines() if "Successfully completed" not in line
                         and "cleaning registries" not in line]
                done = len(out.splitlines()) - len(lines)
                print(f"--- worker w{i} ({done} routine lines left out)\n" + "\n".join(lines[-80:]))
            print(redis_set.events())
