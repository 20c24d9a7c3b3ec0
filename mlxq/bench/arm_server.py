"""Arm D: `mlx_lm.server` (continuous batching behind an OpenAI-style HTTP API), run as its own
process with the same BLAS as mlxq, driven by concurrent streaming HTTP clients (one thread each).

Its API has no `ignore_eos`: requests carry `logit_bias` {eos: -1e9}, so greedy decoding never
picks EOS and every request runs to max_tokens (the bias costs a logits processor per row).
A request counts as failed on any HTTP error, connection reset or short answer.
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time
from typing import Any, Callable, Optional

from mlxq.bench.arms import Arm
from mlxq.bench.procs import ProcessSet, library_loaded, wait_http_ok
from mlxq.bench.workloads import BenchRequest, RequestRecord, Workload
from mlxq.redis_server import free_port

Send = Callable[[BenchRequest, float, float], RequestRecord]


def run_threaded(workload: Workload, send: Send) -> list[RequestRecord]:
    """Closed loop: one thread per client, each sending its requests in turn. Open loop: a thread
    per request, started at its arrival time. `send(request, arrival, t0)` blocks until done."""
    records: list[RequestRecord] = []
    lock = threading.Lock()
    t0 = time.perf_counter()

    def call(request: BenchRequest, arrival: float) -> float:
        try:
            record = send(request, arrival, t0)
        except Exception as exc:  # send records its own errors; this is the last resort
            record = RequestRecord(request.index, arrival, error=f"{type(exc).__name__}: {exc}")
        with lock:
            records.append(record)
        return record.finished if record.finished is not None else time.perf_counter() - t0

    threads: list[threading.Thread] = []
    if workload.kind == "closed":
        clients: dict[int, list[BenchRequest]] = {}
        for request in workload.requests:
            clients.setdefault(request.client, []).append(request)

        def client_loop(queue: list[BenchRequest]) -> None:
            arrival = 0.0
            for request in queue:
                arrival = call(request, arrival)

        threads = [threading.Thread(target=client_loop, args=(q,), daemon=True) for q in clients.values()]
        for thread in threads:
            thread.start()
    else:
        for request in sorted(workload.requests, key=lambda r: r.arrival_s):
            time.sleep(max(0.0, request.arrival_s - (time.perf_counter() - t0)))
            thread = threading.Thread(target=call, args=(request, request.arrival_s), daemon=True)
            thread.start()
            threads.append(thread)
    for thread in threads:
        thread.join()
    return sorted(records, key=lambda r: r.index)


class ServerArm(Arm):
    key = "D"
    methods = {
        "queue": "not observable from the client",
        "ttft": "request sent to the first SSE data chunk (the server streams a chunk once a token yields text)",
        "e2e": "request sent to the end of the stream",
        "eos": "logit_bias {eos: -1e9} (its API has no ignore_eos)",
    }

    def __init__(self, model: str, max_num_seqs: int, prefill_batch_size: int, eos_ids: list[int],
                 procs: ProcessSet, timeout_s: float, blas_path: Optional[str] = None) -> None:
        self.model = model
        self.max_num_seqs = max_num_seqs
        self.prefill_batch_size = prefill_batch_size
        self.logit_bias = {str(t): -1e9 for t in eos_ids}
        self.procs = procs
        self.timeout_s = timeout_s
        self.blas_path = blas_path
        self.port = 0
        self._proc: Any = None

    def start(self) -> None:
        self.port = free_port()
        argv = [sys.executable, "-m", "mlxq.bench.blas_run", "mlx_lm.server", "--model", self.model,
                "--host", "127.0.0.1", "--port", str(self.port),
                "--decode-concurrency", str(self.max_num_seqs),
                "--prompt-concurrency", str(min(self.prefill_batch_size, self.max_num_seqs)),
                "--log-level", "WARNING"]
        self._proc = self.procs.start("mlx_lm-server", argv)
        wait_http_ok("127.0.0.1", self.port, "/health", self._proc, timeout=600)

    def stop(self) -> None:
        if self._proc is not None:
            self.procs.stop(self._proc)
            self._proc = None

    def info(self) -> dict[str, Any]:
        return {
            "command": "python -m mlx_lm.server --decode-concurrency "
                       f"{self.max_num_seqs} --prompt-concurrency {min(self.prefill_batch_size, self.max_num_seqs)}",
            "endpoint": "/v1/completions, stream=true, temperature=0, logit_bias {eos: -1e9}",
            "blas_loaded": library_loaded(self._proc.pid, self.blas_path) if self._proc is not None else None,
        }

    def run(self, workload: Workload, warmup: Optional[Workload]) -> list[RequestRecord]:
        if warmup is not None:
            run_threaded(warmup, self._send)
        return run_threaded(workload, self._send)

    def _send(self, request: BenchRequest, arrival: float, t0: float) -> RequestRecord:
        record = RequestRecord(request.index, arrival)
        body = json.dumps({
            "prompt": request.prompt.text, "max_tokens": request.max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, "logit_bias": self.logit_bias,
        })
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout_s)
        try:
            conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                record.error = f"HTTP {response.status}: {response.read(200)!r}"
                return record
            usage_tokens, chunks, text = None, 0, []
            while True:
                line = response.readline()
                if not line:
                    break
                if not line.startswith(b"data:"):
                    continue  # blank separators and ": keepalive" comments
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
                if event.get("choices"):
                    chunks += 1
                    text.append(event["choices"][0].get("text") or "")
                    if record.first_token is None:
                        record.first_token = time.perf_counter() - t0
            record.finished = time.perf_counter() - t0
            record.tokens = int(usage_tokens) if usage_tokens is not None else 0
            record.extra["text"] = "".join(text)
            if usage_tokens is None:
                record.error = f"stream ended without usage ({chunks} chunks)"
        except (OSError, http.client.HTTPException, ValueError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"[:200]
        finally:
            conn.close()
        return record
