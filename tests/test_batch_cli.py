"""OpenAI Batch files: the I/O-free lines (producer/batchfile.py) and `mlxq batch`, killed and resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from producer.batchfile import BatchLine, LineError, error_line, outcome_line, parse_line
from schemas import GenerationResult
from tests.workers import start_fake_worker, stop, wait_for


def line(custom_id: str, url: str = "/v1/chat/completions", **body: Any) -> str:
    body = {"model": "fake", **body}
    if url.endswith("chat/completions") and "messages" not in body:
        body["messages"] = [{"role": "user", "content": custom_id}]
    elif "prompt" not in body and "messages" not in body:
        body["prompt"] = custom_id
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_parse_line_names_what_is_wrong() -> None:
    good = parse_line(line("a", max_tokens=3, logprobs=True, top_logprobs=2, seed=1), 1)
    assert isinstance(good, BatchLine)
    assert good.request.custom_id == "a" and good.request.top_logprobs == 2 and good.request.messages is not None
    completion = parse_line(line("b", "/v1/completions", prompt=[1, 2, 3], logprobs=1), 2)
    assert isinstance(completion, BatchLine) and completion.request.prompt_token_ids == [1, 2, 3]
    cases = {
        "not json": ("{", None),
        "no custom id": (json.dumps({"url": "/v1/completions", "body": {}}), "custom_id"),
        "bad url": (line("c", "/v1/embeddings"), "url"),
        "bad field": (line("d", max_tokens=0), "body.max_tokens"),
        "unknown field": (line("e", functions=[]), "body.functions"),
        "stream": (line("f", stream=True), "body.stream"),
        "suffix": (line("g", "/v1/completions", suffix="x"), "body.suffix"),
    }
    for name, (text, param) in cases.items():
        error = parse_line(text, 7)
        assert isinstance(error, LineError), name
        assert error.param == param and "line 7" in error.message, (name, error)
        assert error.as_batch_error()["line"] == 7
    other = parse_line(line("h"), 1, endpoint="/v1/completions")
    assert isinstance(other, LineError) and other.param == "url"


def test_outcome_lines() -> None:
    parsed = parse_line(line("a", return_token_ids=True), 1)
    assert isinstance(parsed, BatchLine)
    done = GenerationResult(id="j1", status="finished", prompt_token_ids=[5],
                            choices=[{"index": 0, "text": "hi", "token_ids": [1, 2], "finish_reason": "stop"}])
    is_error, out = outcome_line(parsed, "j1", done, 100)
    assert not is_error and out["custom_id"] == "a" and out["error"] is None
    body = out["response"]["body"]
    assert out["response"]["status_code"] == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == "hi" and body["choices"][0]["token_ids"] == [1, 2]
    assert body["prompt_token_ids"] == [5]
    failed = GenerationResult(id="j2", status="failed", error={"type": "InvalidRequest", "message": "prompt: too long"})
    is_error, out = outcome_line(parsed, "j2", failed, 100)
    assert is_error and out["response"]["status_code"] == 400
    assert out["response"]["body"]["error"]["param"] == "prompt"
    is_error, out = outcome_line(parsed, "j3", GenerationResult(id="j3", status="cancelled"), 100)
    assert is_error and out["response"] is None and out["error"]["code"] == "batch_cancelled"
    assert error_line("x", "batch_expired", "late")["error"] == {"code": "batch_expired", "message": "late"}


def _batch(url: str, tmp: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "mlxq", "batch", "-i", str(tmp / "in.jsonl"), "-o", str(tmp / "out.jsonl"),
         "--url", url, "--max-in-flight", "6", "--no-progress", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ})


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(text) for text in path.read_text().splitlines() if text.strip()] if path.exists() else []


@pytest.mark.slow
def test_mlxq_batch_resumes_after_a_kill_without_running_a_line_twice(
        redis_url: str, redis_conn: redis.Redis, tmp_path: Path) -> None:
    count = 36
    with (tmp_path / "in.jsonl").open("w") as handle:
        for i in range(count):
            url = "/v1/completions" if i % 3 == 0 else "/v1/chat/completions"
            handle.write(line(f"req-{i}", url, max_tokens=12) + "\n")
        handle.write("\n" + line("bad", max_tokens=0) + "\n")
    worker = start_fake_worker(redis_url, "--model", "fake", step_delay_s=0.03)
    try:
        first = _batch(redis_url, tmp_path)
        # Killed with jobs submitted whose lines are not written yet (it submits its next window only
        # after writing the last one's lines, so at ten lines alone every job it had may be written).
        def midway() -> bool:
            written = len(_lines(tmp_path / "out.jsonl"))
            return written >= 10 and len(redis_conn.keys("rq:job:mlxqbatch-*")) > written

        wait_for(midway, timeout=60, interval=0.01, what="ten output lines and jobs in flight")
        first.send_signal(signal.SIGKILL)
        first.wait()
        halfway = len(_lines(tmp_path / "out.jsonl"))
        assert halfway < count, "the first run should not have finished"
        second = _batch(redis_url, tmp_path)
        out, _ = second.communicate(timeout=120)
    finally:
        stop(worker)
    assert second.returncode == 1, out  # the bad line failed
    assert "already done" in out and "jobs of an earlier run picked up" in out
    results = _lines(tmp_path / "out.jsonl")
    errors = _lines(tmp_path / "out.errors.jsonl")
    ids = [r["custom_id"] for r in results]
    assert sorted(ids) == sorted(f"req-{i}" for i in range(count)) and len(set(ids)) == count
    assert [e["custom_id"] for e in errors] == ["bad"] and errors[0]["error"]["code"] == "invalid_request"
    for result in results:
        body = result["response"]["body"]
        assert result["response"]["status_code"] == 200
        assert body["object"] == ("text_completion" if int(result["custom_id"][4:]) % 3 == 0 else "chat.completion")
        assert body["usage"]["completion_tokens"] == 12
    # every line's job ran exactly once: one job per line, and one rq execution result each
    job_ids = [r["response"]["request_id"] for r in results]
    assert len(set(job_ids)) == count
    assert len(redis_conn.keys("rq:job:mlxqbatch-*")) == count
    assert all(redis_conn.xlen(f"rq:results:{job_id}") == 1 for job_id in job_ids)

    # a third run finds everything done and submits nothing
    third = _batch(redis_url, tmp_path)
    out, _ = third.communicate(timeout=60)
    assert "0 completed" in out and len(_lines(tmp_path / "out.jsonl")) == count
