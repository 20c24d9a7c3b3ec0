"""The worker's own CPU time per job: a fake-engine worker run from one tree, three bursts of N
one-token jobs, the worker's user+system time read from /proc around them (Linux); with `spy`,
py-spy records the worker meanwhile (collapsed stacks in OUT).

    python docs/bench/cpu/restructure/cpu_per_job.py TREE OUT.txt 3000 [spy]
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def body(i: int) -> dict:
    return {"prompt_token_ids": [1 + i % 250, 2, 3], "max_tokens": 1, "temperature": 0.0, "ignore_eos": True}


def main() -> None:
    tree, out, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    sys.path.insert(0, tree)
    from producer import Client

    port = free_port()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
                              stdout=subprocess.DEVNULL)
    time.sleep(0.3)
    url = f"redis://127.0.0.1:{port}/0"
    worker = subprocess.Popen([sys.executable, "-m", "mlxq.bench.fake_worker", "--url", url, "--name", "w1",
                               "--max-num-seqs", "256", "default"], env={**os.environ, "PYTHONPATH": tree}, cwd=tree)
    client = Client(url)
    try:
        client.wait_many(client.submit_many([body(i) for i in range(100)], queue="default"), timeout=120)  # warm-up
        spy = None
        if len(sys.argv) > 4 and sys.argv[4] == "spy":
            spy = subprocess.Popen(["py-spy", "record", "-p", str(worker.pid), "-r", "250", "-f", "raw", "-o", out,
                                    "--threads", "-d", "60"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        before, rates = cpu_seconds(worker.pid), []
        for _ in range(3):
            started = time.perf_counter()
            results = client.wait_many(client.submit_many([body(i) for i in range(n)], queue="default"), timeout=300)
            rates.append(n / (time.perf_counter() - started))
            assert all(r.status == "finished" for r in results.values())
        per_job_us = (cpu_seconds(worker.pid) - before) / (3 * n) * 1e6
        if spy is not None:
            spy.send_signal(2)
            spy.wait()
        print(tree, "jobs/s", [round(r) for r in rates], "worker CPU us/job", round(per_job_us))
    finally:
        worker.terminate()
        worker.wait()
        server.terminate()


if __name__ == "__main__":
    main()
