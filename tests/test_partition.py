"""Hosts with their own addresses (tests/netns.py): Redis on one, three fake-engine workers on three more, the
producer (this test) on a fifth. One worker host's cable is pulled mid-batch: its jobs' heartbeats lapse, a
live worker's sweep sends them back to their queue (worker/recovery.py) and another worker runs them; none
is lost and the first result stays. The cable goes back: the cut worker finds its jobs taken, drops them
without writing, and takes new work as before."""

from __future__ import annotations

import re
import sys
import time

import pytest
import redis
from rq.job import Job

from producer import Client
from schemas import keys
from tests.netns import lab, namespaces_available
from worker.engines.fake import fake_token

pytestmark = pytest.mark.slow

blocked = namespaces_available()
if blocked is not None:
    pytest.skip(f"network namespaces cannot be made here: {blocked}", allow_module_level=True)

MAX_TOKENS = 120  # 3.6 s a job at the step delay below
WORKER_ENV = {"MLXQ_ENGINE": "fake", "MLXQ_FAKE_STEP_DELAY_S": "0.03", "MLXQ_HEARTBEAT_INTERVAL_S": "1",
              "MLXQ_SWEEP_INTERVAL_S": "2", "MLXQ_ALIAS": "part", "MLXQ_MAX_NUM_SEQS": "20"}


def request(index: int) -> dict:
    return {"model": "part", "prompt_token_ids": [1 + index, 7], "max_tokens": MAX_TOKENS, "temperature": 0}


def tokens(index: int) -> list[int]:
    return [fake_token([1 + index, 7], k) for k in range(MAX_TOKENS)]


def until(check, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def test_a_cut_worker_host_loses_its_jobs_to_a_live_one_and_rejoins_without_writing_them():
    with lab("redis", "producer", "w1", "w2", "w3") as hosts:
        server = hosts.hosts["redis"]
        server.popen(["redis-server", "--port", "6379", "--bind", server.address, "--save", "", "--appendonly", "no",
                      "--protected-mode", "no"])
        url = f"redis://{server.address}:6379/0"
        producer = hosts.hosts["producer"]
        client: Client = producer.run(lambda: Client(url))
        until(lambda: producer.run(lambda: _pings(client)), 10, "Redis on its host")
        workers = {name: hosts.hosts[name].popen([sys.executable, "-m", "mlxq", "worker", "--url", url, "--name", name],
                                                 env=WORKER_ENV) for name in ("w1", "w2", "w3")}
        outputs: dict[str, str] = {}
        try:
            until(lambda: len(producer.run(client.models)) == 1 and producer.run(client.models)[0].workers == 3,
                  60, "three live workers")
            ids = producer.run(lambda: client.submit_many([request(i) for i in range(60)], retry=2))
            on_w1 = until(lambda: producer.run(lambda: _running_on(client, ids, "w1")), 30, "jobs running on w1")
            hosts.hosts["w1"].cut()
            # Its heartbeats lapse (TTL 8 s); a live worker's sweep (every 2 s) sends its jobs back.
            until(lambda: producer.run(lambda: _all_taken(client, on_w1)), 40, "w1's jobs started elsewhere")
            hosts.hosts["w1"].restore()
            results = producer.run(lambda: client.wait_many(ids, timeout=60))
            assert all(results[j].status == "finished" for j in ids), {j: results[j].status for j in ids}
            assert all(results[j].choices[0].token_ids == tokens(i) for i, j in enumerate(ids))
            assert all(results[j].worker != "w1" for j in on_w1)
            # Once back, w1 finds its jobs taken (each, as its run of it ends) and writes none of them.
            until(lambda: producer.run(lambda: _idle(client, "w1")), 30, "w1 to finish what it had")
            time.sleep(2)
            assert {j: producer.run(lambda: client.result(j)).worker for j in on_w1} == {j: results[j].worker
                                                                                          for j in on_w1}
            # It rejoins: alone now, it runs new jobs.
            for name in ("w2", "w3"):
                workers[name].terminate()
                outputs[name] = workers[name].communicate(timeout=30)[0]
            more = producer.run(lambda: client.submit_many([request(100 + i) for i in range(5)]))
            again = producer.run(lambda: client.wait_many(more, timeout=60))
            assert {r.worker for r in again.values()} == {"w1"} and all(r.status == "finished" for r in again.values())
        finally:
            for name, proc in workers.items():
                if proc.poll() is None:
                    proc.terminate()
                    try:
                        outputs[name] = proc.communicate(timeout=30)[0]
                    except Exception:
                        proc.kill()
                        outputs[name] = proc.communicate()[0]
            for name, out in sorted(outputs.items()):
                lines = [line for line in (out or "").splitlines() if "Successfully completed" not in line
                         and "cleaning registries" not in line]
                print(f"--- {name}\n" + "\n".join(lines[-60:]))
            producer.run(client.close)
        # Either it saw the job gone from the started registry before writing, or its write found the other
        # run's result there first (then it wrote nothing else either): both are logged.
        dropped = set(re.findall(r"job (\S+)(?: \(worker\.tasks\.generate\) was taken by another worker|: another "
                                 r"run of it wrote its result first)", outputs["w1"]))
        assert dropped == set(on_w1), (sorted(dropped), sorted(on_w1))
        print(f"w1 was cut with {len(on_w1)} jobs running; all ran elsewhere and w1 dropped each unwritten")


def _pings(client: Client) -> bool:
    try:
        return bool(client.connection.ping())
    except redis.ConnectionError:
        return False


def _running_on(client: Client, ids: list[str], worker: str) -> list[str]:
    """The jobs `worker` runs now, once it runs several."""
    with client.connection.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.hmget(Job.key_for(job_id), "worker_name", "status")
        rows = pipe.execute()
    mine = [j for j, (name, status) in zip(ids, rows) if name == worker.encode() and status == b"started"]
    return mine if len(mine) >= 3 else []


def _all_taken(client: Client, job_ids: list[str]) -> bool:
    """Every job was sent back and started (or finished) on another worker."""
    with client.connection.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hget(Job.key_for(job_id), "worker_name")
        return all(name not in (None, b"w1") for name in pipe.execute())


def _idle(client: Client, worker: str) -> bool:
    raw = client.connection.get(keys.worker_key(worker))
    return raw is not None and b'"running":0' in raw
