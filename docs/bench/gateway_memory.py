"""The gateway's memory while it serves one large result (docs/gateway.md, "Large results").

A real `mlxq api` process, a fake-engine worker and a private redis-server. One request of `n` choices,
`max_tokens` tokens each and `top_logprobs` alternatives per token is served three ways, each measured
as the gateway's peak resident memory (VmHWM, reset before each) above its resident memory before it:

- `jobs`: `POST /v1/jobs`, then `GET /v1/jobs/{id}` of the finished job;
- `chat`: a blocking `POST /v1/chat/completions`;
- `batch`: a batch of that one line, then `GET /v1/files/{output}/content`.

    PYTHONPATH=. python docs/bench/gateway_memory.py --n 16 --max-tokens 4096 --top-logprobs 20

Linux only (it reads /proc/<pid>/status and resets the peak through /proc/<pid>/clear_refs).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import redis

from mlxq.redis_server import RedisServer, free_port

MIB = 1024 * 1024


def memory(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def measured(pid: int, action: Callable[[], int]) -> dict[str, Any]:
    """Run `action` (which returns the bytes it received) and the gateway's memory around it."""
    time.sleep(1.0)  # let the allocator settle after the previous step
    reset_peak(pid)
    before = memory(pid)["VmRSS"]
    started = time.monotonic()
    received = action()
    seconds = time.monotonic() - started
    after = memory(pid)
    return {"rss_before_mib": round(before / MIB, 1), "peak_above_before_mib": round((after["VmHWM"] - before) / MIB, 1),
            "rss_after_mib": round(after["VmRSS"] / MIB, 1), "response_mib": round(received / MIB, 2),
            "seconds": round(seconds, 2)}


def wait_up(url: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--top-logprobs", type=int, default=20)
    parser.add_argument("--max-result-entries", type=int, default=None,
                        help="MLXQ_MAX_RESULT_ENTRIES / MLXQ_API_MAX_RESULT_ENTRIES for the run (default: large "
                             "enough for the request)")
    parser.add_argument("--only", nargs="+", choices=("jobs", "chat", "batch"), default=("jobs", "chat", "batch"))
    parser.add_argument("--out", type=Path, help="write the JSON here too")
    args = parser.parse_args()
    entries = args.max_result_entries or args.n * args.max_tokens * (1 + args.top_logprobs)
    logs = Path(tempfile.mkdtemp(prefix="mlxq-gateway-memory-"))
    body = {"model": "fake", "n": args.n, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
    if args.top_logprobs:
        body |= {"logprobs": True, "top_logprobs": args.top_logprobs}
    procs: list[subprocess.Popen[bytes]] = []
    report: dict[str, Any] = {}
    with RedisServer() as server:
        env = {**os.environ, "MLXQ_ENGINE": "fake", "MLXQ_MAX_NUM_SEQS": str(max(args.n, 1)),
               "MLXQ_MAX_TOKENS_LIMIT": str(args.max_tokens), "MLXQ_MAX_RESULT_ENTRIES": str(entries),
               "MLXQ_API_MAX_TOKENS": str(args.max_tokens), "MLXQ_API_MAX_RESULT_ENTRIES": str(entries),
               "MLXQ_API_FILE_QUOTA_BYTES": str(1 << 40), "MLXQ_API_BATCH_DRIVE_INTERVAL_S": "0.2"}
        try:
            for name, argv in (("worker", ["worker", "--name", "fake", "--model", "fake"]),
                               ("gateway", ["api", "--port", str(port := free_port()), "--log-level", "warning"])):
                with open(logs / f"{name}.log", "wb") as log:
                    procs.append(subprocess.Popen([sys.executable, "-m", "mlxq", *argv, "--url", server.url],
                                                  stdout=log, stderr=subprocess.STDOUT, env=env))
            base = f"http://127.0.0.1:{port}"
            wait_up(f"{base}/v1/models", procs[1])
            conn = redis.Redis.from_url(server.url)
            while not conn.exists("mlxq:worker:fake"):
                time.sleep(0.1)
            gateway_pid = procs[1].pid
            http = httpx.Client(base_url=base, timeout=600)

            job_id = http.post("/v1/jobs", json={**{k: v for k, v in body.items()}, "prompt": "x"}).json()["id"]
            while not conn.exists(f"mlxq:result:{job_id}"):  # (no poll through the gateway: it would read it)
                time.sleep(0.5)
            result_bytes = conn.strlen(f"mlxq:result:{job_id}")
            report |= {"request": body, "result_key_mib": round(result_bytes / MIB, 2),
                                      "max_result_entries": entries}
            if "jobs" in args.only:
                report["jobs"] = measured(gateway_pid, lambda: len(http.get(f"/v1/jobs/{job_id}").content))

            def chat() -> int:
                response = http.post("/v1/chat/completions", json={**body, "messages": [{"role": "user",
                                                                                          "content": "x"}]})
                response.raise_for_status()
                return len(response.content)

            if "chat" in args.only:
                report["chat"] = measured(gateway_pid, chat)

            line = json.dumps({"custom_id": "big", "method": "POST", "url": "/v1/chat/completions",
                               "body": {**body, "messages": [{"role": "user", "content": "x"}]}})
            response = http.post("/v1/files", data={"purpose": "batch"},
                                 files={"file": ("in.jsonl", io.BytesIO(line.encode() + b"\n"))})
            assert response.status_code == 200, response.text
            uploaded = response.json()

            def batch() -> int:
                created = http.post("/v1/batches", json={"input_file_id": uploaded["id"],
                                                         "endpoint": "/v1/chat/completions"})
                assert created.status_code == 200, created.text
                while True:
                    polled = http.get(f"/v1/batches/{created.json()['id']}")
                    assert polled.status_code == 200, polled.text
                    if (state := polled.json())["status"] in ("completed", "failed", "cancelled", "expired"):
                        break
                    time.sleep(0.2)
                assert state["status"] == "completed", state
                return len(http.get(f"/v1/files/{state['output_file_id']}/content").content)

            if "batch" in args.only:
                report["batch"] = measured(gateway_pid, batch)
            # Commands that held Redis longest: a result this large is written and read in one command each.
            report["redis_slowest_ms"] = sorted((round(entry["duration"] / 1000), " ".join(
                str(arg)[:40] for arg in entry["command"].split()[:2]) if isinstance(entry["command"], str) else
                str(entry["command"])[:60]) for entry in conn.slowlog_get(128))[-5:]
        except BaseException:
            print(json.dumps(report, indent=1), file=sys.stderr)
            for name in ("worker", "gateway"):
                print(f"--- {name}\n" + (logs / f"{name}.log").read_text()[-3000:], file=sys.stderr)
            raise
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(30)
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
