"""The `mlxq` command line, run as users run it: as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from producer import Client
from tests.workers import start_worker, stop

pytestmark = pytest.mark.slow


def mlxq(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mlxq", *args], capture_output=True, text=True, timeout=timeout)


def test_every_verb_has_help(capsys):
    """`mlxq --help` as a user runs it names every verb; each verb's own help comes from the same parser,
    read in this process (a subprocess each cost ~2 s of imports and proved nothing more)."""
    from mlxq.cli import main

    verbs = ["worker", "submit", "status", "result", "cancel", "demo", "make-tiny-model"]
    done = mlxq("--help")
    assert done.returncode == 0 and all(verb in done.stdout for verb in verbs), done.stdout
    for verb in verbs:
        with pytest.raises(SystemExit) as exited:
            main([verb, "--help"])
        assert exited.value.code == 0 and "usage: mlxq " + verb in capsys.readouterr().out, verb


def test_make_tiny_model_builds_a_loadable_model(tmp_path):
    done = mlxq("make-tiny-model", str(tmp_path / "m"))
    assert done.returncode == 0, done.stderr
    names = {p.name for p in (tmp_path / "m").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(str(tmp_path / "m"))) == config["vocab_size"]


def test_submit_result_and_cancel_a_running_job(redis_url, tiny_model_dir, tmp_path):
    proc = start_worker(redis_url, tiny_model_dir, name="cli")
    try:
        done = mlxq("submit", "--url", redis_url, "--prompt", "hello", "--max-tokens", "3", "--wait", "120")
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert result["status"] == "finished" and result["usage"]["completion_tokens"] >= 1

        bad = mlxq("submit", "--url", redis_url, "--prompt", "hello", "--max-tokens", "0")
        assert bad.returncode == 2 and "max_tokens" in bad.stderr

        request_file = tmp_path / "long.json"
        request_file.write_text(json.dumps({"prompt_token_ids": [1, 2, 3], "max_tokens": 4000, "ignore_eos": True}))
        long_job = mlxq("submit", "--url", redis_url, "--json", str(request_file), timeout=30)
        assert long_job.returncode == 0, long_job.stderr
        job_id = long_job.stdout.strip().splitlines()[-1]
        client = Client(redis_url)
        deadline = time.monotonic() + 60
        while client.status(job_id) != "started":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert mlxq("cancel", "--url", redis_url, job_id).returncode == 0
        cancelled = client.wait(job_id, timeout=30)
        assert cancelled.status == "cancelled"
        assert cancelled.choices[0].finish_reason == "cancelled"
        assert 0 < len(cancelled.choices[0].token_ids) < 4000
        assert mlxq("status", "--url", redis_url, job_id).stdout.strip() == "cancelled"
        assert client.wait(client.submit({"prompt": "x", "max_tokens": 2}), timeout=30).status == "finished"
    finally:
        out = stop(proc)
    assert proc.returncode == 0, out


def test_demo_runs_end_to_end_on_its_own_redis_and_the_real_model(real_model):
    done = mlxq("demo", "--jobs", "8", "--max-tokens", "8", "--threads", "2", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "started a private redis-server" in done.stdout
    assert "8 jobs from 2 threads" in done.stdout and ", 0 failed" in done.stdout
    assert "after the worker started: 'What is the capital of France?' -> 'The capital of France is Paris.'" \
        in done.stdout, done.stdout
